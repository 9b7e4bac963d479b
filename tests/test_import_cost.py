"""What ``import trainer_integration`` loads in a training process that has Ray Train and
torch already: none of the registry's, the settings' or the HTTP API's libraries (they
load on first use, off the training thread), nor Ray Tune or Ray's trainers.

The time it takes is measured in benchmarks/README.md ("Import cost"), not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Packages (and their submodules) that importing trainer_integration must not load.
HEAVY = (
    "sqlalchemy",
    "alembic",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic_settings",
    "ray.tune",
    "ray.train.torch",
    "ray.train.tensorflow",
)

PROGRAM = """
import json, sys
import ray.train, torch
before = set(sys.modules)
import trainer_integration
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_importing_trainer_integration_after_ray_train_and_torch_loads_no_heavy_library():
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "trainer_integration" in loaded
    # What a rank's first report() uses on the training thread is there already, light:
    # it never waits for the import lock while a reporter thread imports the registry.
    assert "validation_service.parts" in loaded
    heavy = [name for name in loaded if any(name == h or name.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], f"import trainer_integration loaded {heavy}"
