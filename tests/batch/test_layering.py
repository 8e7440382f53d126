"""batch/ never imports gristmill.ray: ray/ is built on batch/, and batch/ reaches the Ray
parts it offers by name (gristmill.extras)."""

from pathlib import Path

import gristmill.batch
from tests.test_layering import fresh_imports


def test_batch_and_the_cli_import_no_ray():
    # A fresh interpreter (one for all such checks): other tests in the same run may
    # import gristmill.ray.
    modules = sorted(f"gristmill.batch.{p.stem}" for p in Path(gristmill.batch.__file__).parent.glob("*.py")
                     if p.stem != "__init__")
    assert "gristmill.batch.processor" in modules and "gristmill.batch.cli" in modules
    report = fresh_imports()["batch"]
    assert report["modules"] == modules  # every module of batch/ was imported there, and gristmill.cli
    assert report["ray"] == []
