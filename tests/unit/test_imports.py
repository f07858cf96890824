"""The control plane, the loop, config and the planner never load torch."""

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_control_and_loop_do_not_import_torch():
    code = (
        "import sys\n"
        "import tether.control, tether.loop, tether.config, tether.cli.main\n"
        "from tether.loop import fakes, virtual\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


def test_public_surface():
    import tether.control
    import tether.loop

    for module in (tether.control, tether.loop):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
