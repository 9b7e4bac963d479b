"""A PyTorch Lightning script with ckval: each epoch's checkpoint is validated elsewhere.

python examples/lightning_trainer.py [--epochs 4] [--run lightning-example]

The LightningModule has no validation_step: each epoch's checkpoint.ckpt is reported to
ckval and scored in a Ray task while training goes on, and the held-out accuracy comes
back into trainer.callback_metrics as val_acc, where Lightning's own ModelCheckpoint
reads it. Digits ship with scikit-learn: nothing is downloaded. Inside Ray Train, the
same callback goes into the train function (see docs/lightning.md).
"""

import argparse
import logging
import os
import tempfile

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from ray.train import Checkpoint

from trainer_integration.lightning import CHECKPOINT_NAME, ReportCheckpointCallback
from validation_service.cli.demo import load_digits_split, make_model


class DigitsClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()  # 64 -> hidden -> 10

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def validate_fn(checkpoint: Checkpoint, config: dict) -> dict:
    """Held-out accuracy of the reported checkpoint.ckpt (runs later, in a Ray task)."""
    with checkpoint.as_directory() as directory:
        saved = torch.load(os.path.join(directory, CHECKPOINT_NAME), weights_only=False)
    model = make_model()
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved["state_dict"].items()})
    _, x_val, _, y_val = load_digits_split()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(dim=1).numpy()
    return {"val_acc": float(np.mean(predicted == y_val))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--run", default="lightning-example")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.manual_seed(0)
    x_train, _, y_train, _ = load_digits_split()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        batch_size=64,
        shuffle=True,
    )
    callback = ReportCheckpointCallback(validate_fn=validate_fn, run=args.run)
    with tempfile.TemporaryDirectory(prefix="lightning-example-") as folder:
        # Lightning's own callback, driven by the value ckval validated (an earlier epoch's).
        best_so_far = ModelCheckpoint(dirpath=folder, monitor="val_acc", mode="max")
        trainer = pl.Trainer(
            max_epochs=args.epochs,
            accelerator="cpu",
            callbacks=[callback, best_so_far],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(DigitsClassifier(), loader)
        print(f"training done: train_loss {float(trainer.callback_metrics['train_loss']):.4f}")
    received = callback.wait(timeout_s=300)
    for index, metrics in sorted(received.items()):
        print(f"checkpoint {index}: val_acc {metrics['val_acc']:.4f}")
    [(best, metrics)] = callback.best_checkpoints("val_acc", k=1)
    print(f"best checkpoint: epoch {metrics['epoch']}, val_acc {metrics['val_acc']:.4f}")
    print(f"stored at {best.path}")


if __name__ == "__main__":
    main()
