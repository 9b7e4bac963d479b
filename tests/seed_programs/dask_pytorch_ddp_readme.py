"""dask-pytorch-ddp's README program ("Now on Dask"), with ckval.

Changed from the README, and why:
- imports: ``DaskResultsHandler`` and ``S3ImageFolder`` (which the training function calls
  ``BOTOS3ImageFolder``) come from ``trainer_integration.dask``; torchvision's ``models``
  and ``transforms`` from a stand-in (no CPU build of torchvision here);
- ``DaskResultsHandler(key, validate_fn=...)``: the one ckval argument;
- no GPU here: ``torch.device(0)`` is ``torch.device("cpu")``, ``.cuda()`` is left out
  and ``DDP(model)`` has no ``device_ids``;
- what the README leaves undefined (``transform``, ``train_sampler``, ``batch_size``,
  ``num_workers``) is defined below, small; the checkpoint names keep the README's
  ``checkpoint-{datetime.now().isoformat()}.pkl``, ``:`` included.
"""

import datetime
import json
import multiprocessing as mp
import pickle
import uuid

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.seed_programs._torchvision_standin import models, transforms
from tests.seed_programs._validation import dask_readme_accuracy
from trainer_integration.dask import ResultsHandler as DaskResultsHandler
from trainer_integration.dask import S3ImageFolder as BOTOS3ImageFolder

# What the README defines elsewhere or leaves to the reader.
transform = transforms.Compose(
    [transforms.Resize(20), transforms.CenterCrop(16), transforms.ToTensor()]
)
train_sampler = None
batch_size = 1
num_workers = 1


key = uuid.uuid4().hex
rh = DaskResultsHandler(key, validate_fn=dask_readme_accuracy)


def run_transfer_learning(bucket, prefix, samplesize, n_epochs):
    worker_rank = int(dist.get_rank())
    device = torch.device("cpu")
    net = models.resnet18(pretrained=False)
    model = net.to(device)
    model = DDP(model)

    criterion = nn.CrossEntropyLoss()
    lr = 0.001 * dist.get_world_size()
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    whole_dataset = BOTOS3ImageFolder(bucket, prefix, transform=transform)
    train_loader = torch.utils.data.DataLoader(
        whole_dataset,
        sampler=train_sampler,
        batch_size=batch_size,
        num_workers=num_workers,
        multiprocessing_context=mp.get_context("fork"),
    )
    count = 0
    for epoch in range(n_epochs):
        # Each epoch has a training and validation phase
        model.train()  # Set model to training mode
        for inputs, labels in train_loader:
            dt = datetime.datetime.now().isoformat()
            inputs = inputs.to(device)
            labels = labels.to(device)
            outputs = model(inputs)
            _, preds = torch.max(outputs, 1)
            loss = criterion(outputs, labels)

            # zero the parameter gradients
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            count += 1

            # statistics
            rh.submit_result(
                f"worker/{worker_rank}/data-{dt}.json",
                json.dumps(
                    {"loss": loss.item(), "epoch": epoch, "count": count, "worker": worker_rank}
                ),
            )
            if (count % 100) == 0 and worker_rank == 0:
                rh.submit_result(f"checkpoint-{dt}.pkl", pickle.dumps(model.state_dict()))
