"""batch/ never imports gristmill.ray: ray/ is built on batch/, and batch/ reaches the Ray
parts it offers by name (gristmill.extras)."""

import subprocess
import sys
from pathlib import Path

import gristmill.batch


def test_batch_and_the_cli_import_no_ray():
    # A fresh interpreter: other tests in the same run may import gristmill.ray.
    modules = sorted(f"gristmill.batch.{p.stem}" for p in Path(gristmill.batch.__file__).parent.glob("*.py"))
    assert "gristmill.batch.processor" in modules and "gristmill.batch.cli" in modules
    code = (f"import sys, gristmill.cli, {', '.join(m for m in modules if not m.endswith('__init__'))}; "
            "loaded = sorted(n for n in sys.modules if n == 'ray' or n.startswith(('ray.', 'gristmill.ray'))); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)
