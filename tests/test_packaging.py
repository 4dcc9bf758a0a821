"""pyproject.toml lists every package explicitly (models/ and conf/ install under the mpoverlap
name, so setuptools' discovery cannot find them): a folder missing from the list would be left
out of a wheel and reported by setuptools at every install."""
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_with_its_yaml():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"mpoverlap": ROOT / "mpoverlap", **{name: ROOT / folder for name, folder in tool["package-dir"].items()}}
    found, with_yaml = set(), set()
    for name, root in roots.items():
        for folder in [root, *root.rglob("*")]:
            if not folder.is_dir() or folder.name == "__pycache__":
                continue
            package = ".".join((name, *folder.relative_to(root).parts))
            if any(folder.glob("*.yaml")):
                with_yaml.add(package)
            if any(folder.glob("*.py")) or package in with_yaml:
                found.add(package)
    listed = set(tool["packages"])
    assert found == listed, f"unlisted: {sorted(found - listed)}, listed but absent: {sorted(listed - found)}"
    data = tool["package-data"]
    assert all("*.yaml" in data.get(p, []) for p in with_yaml), sorted(p for p in with_yaml if p not in data)


def test_the_torch_floor_is_the_one_the_start_up_check_enforces():
    from mpoverlap.overlap.environment_rules import TORCH_FLOOR

    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = [r for r in requirements if r.replace(" ", "").startswith("torch>=")]
    assert torch_req == [f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"], requirements
