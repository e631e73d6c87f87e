"""The wheel outside the checkout: built from pyproject.toml, installed without the
repo on the path, it finds its presets and the demo model (package data), runs
`--help`, `plan`, and `generate` with no `--model`."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_wheel_works_outside_the_checkout(tmp_path):
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)], tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("jaxinfer-*.whl")
    # A fresh venv holding only the wheel; its dependencies come from the test venv's
    # site-packages through a .pth line, which adds that directory but runs none of its
    # .pth files, so the test venv's editable jaxinfer stays out of sight.
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                tmp_path).returncode == 0
    python = venv / "bin" / "python"
    site = pathlib.Path(_run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], tmp_path)
                        .stdout.strip())
    installed = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                      "--target", str(site), str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run([str(python), "-c", "import jaxinfer; print(jaxinfer.__file__)"], tmp_path)
    assert where.stdout.strip() == str(site / "jaxinfer" / "__init__.py"), where.stderr
    helped = _run([str(python), "-m", "jaxinfer", "--help"], tmp_path)
    assert helped.returncode == 0 and "generate" in helped.stdout, helped.stderr
    planned = _run([str(python), "-m", "jaxinfer", "plan", "--model=llama3.1-8b",
                    "--device=v5e-8"], tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "v5e-8" in planned.stdout
    generated = _run([str(python), "-m", "jaxinfer", "generate", "--max_tokens=8"], tmp_path)
    assert generated.returncode == 0, generated.stderr[-2000:]
    demo = site / "jaxinfer" / "demo"
    assert (demo / "model.safetensors").is_file() and not demo.is_symlink()
    assert generated.stdout.strip(), generated.stderr[-2000:]
