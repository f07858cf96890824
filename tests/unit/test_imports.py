"""The control plane, the loop, config and the planner never load torch."""

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_control_and_loop_do_not_import_torch():
    code = (
        "import sys\n"
        "import tether, tether.control, tether.loop, tether.config, tether.cli.main, tether.vocabulary\n"
        "from tether.config import load_config\n"
        "load_config(None, ['model.family=text'])\n"
        "from tether.loop import fakes, virtual\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


def test_public_surface():
    import tether
    import tether.control
    import tether.loop

    for module in (tether, tether.control, tether.loop):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
    expected = {"train", "load_config", "Config", "TetherError", "ConfigError", "register_loss",
                "register_advantage", "register_kl", "register_task", "register_reward", "register_family",
                "Family", "FamilyBase", "Capabilities"}
    assert expected <= set(tether.__all__)
    import tether.errors

    errors = {n for n, v in vars(tether.errors).items()
              if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == "tether.errors"}
    assert errors <= set(tether.__all__), f"missing from tether.__all__: {errors - set(tether.__all__)}"
