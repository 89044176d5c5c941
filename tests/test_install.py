"""The fresh-install regression: no folder of this project may share an import name with an installed
distribution (transformers 5.25 imports Hugging Face's `kernels`, which a local `kernels/` once shadowed)."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_local_package_shadows_an_installed_one():
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions providing it
    local = [d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))]
    assert "rlhf_kernels" in local
    clashes = {name: installed[name] for name in local if name in installed}
    assert not clashes, f"these folders have the import name of installed distributions: {clashes}"


def test_transformers_hub_kernels_and_ppo_import_together():
    try:
        hub_kernels = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers before 5.25 does not require it)")
    # From the project root, where a local kernels/ would come first on sys.path.
    code = "\n".join(
        [
            "import os",
            "import transformers.integrations.hub_kernels",
            "import ppo",
            "import kernels",
            "from kernels import Mode",
            "print(os.path.dirname(os.path.abspath(kernels.__file__)))",
        ]
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(hub_kernels.locate_file("kernels")), (
        f"'kernels' was not the installed distribution: {result.stdout}"
    )
