"""A non-editable install (the wheel) holds every package, the shipped run and DeepSpeed configs, and installs the
`kernels/` folder as `megahybrid_kernels`, so it sits beside Hugging Face's `kernels` package (issue #17)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import kernels, megahybrid, megahybrid_kernels.nats, megahybrid_kernels.interdomain
from megahybrid.train.config import load_config, load_deepspeed_config
assert kernels.HUB, "the other kernels package was shadowed"
assert load_deepspeed_config("zero3")["zero_optimization"]["stage"] == 3
assert load_config("natsl-340m").model.preset
print(megahybrid.__file__, megahybrid_kernels.nats.__file__)
"""


def _wheel(tmp_path) -> Path:
    """Built from the checkout; setuptools' build/ scratch folder is removed again unless it was there before."""
    had_build = (REPO / "build").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, timeout=300,
                   cwd=tmp_path)
    if not had_build:
        shutil.rmtree(REPO / "build", ignore_errors=True)
    return next((tmp_path / "dist").glob("megahybrid-*.whl"))


@pytest.mark.slow
def test_wheel_installs_beside_the_hub_kernels_package(tmp_path):
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for init in [*REPO.glob("megahybrid/**/__init__.py"), *REPO.glob("kernels/**/__init__.py")]:
        rel = init.relative_to(REPO).as_posix()
        rel = "megahybrid_kernels" + rel[len("kernels"):] if rel.startswith("kernels/") else rel
        assert rel in names, f"{rel} missing from the wheel: add its package to pyproject.toml"
    shipped = [*REPO.glob("megahybrid/configs/**/*.yaml"), *REPO.glob("ds_configs/*.json")]
    for path in shipped:
        rel = path.relative_to(REPO).as_posix()
        assert ("megahybrid/" + rel if rel.startswith("ds_configs/") else rel) in names, f"{rel} missing"
    assert not any(n.startswith("kernels/") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text("HUB = True\n")  # stands in for Hugging Face's package
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(path.startswith(str(site)) for path in proc.stdout.split()), proc.stdout
