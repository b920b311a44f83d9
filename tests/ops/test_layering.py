"""Kernels are reached only through `cat_fast.ops`: no module outside `cat_fast/ops/` and `cat_fast/kernels/` imports
a kernel module (`cat_fast.kernels.*`, `cat_fast._C`, Triton)."""
import ast
import pathlib

import cat_fast

PACKAGE = pathlib.Path(cat_fast.__file__).parent
KERNEL_MODULES = ("cat_fast.kernels", "cat_fast._C", "triton")


def _imported(path, root):
    """The absolute names of the modules (and `from` members) that the file at `path` (in package `root`) imports."""
    module = ".".join(("cat_fast", *path.relative_to(root).with_suffix("").parts))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            yield name
            yield from (f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cat_fast."):
            yield node.value  # importlib.import_module("cat_fast._C") and the like


def _is_kernel(name):
    return any(name == k or name.startswith(k + ".") for k in KERNEL_MODULES)


def offenders(root=PACKAGE):
    found = []
    for path in sorted(root.rglob("*.py")):
        top = path.relative_to(root).parts[0]
        if top in ("ops", "kernels"):
            continue
        found += [f"{path.relative_to(root)}: {name}" for name in _imported(path, root) if _is_kernel(name)]
    return found


def test_only_ops_and_kernels_import_kernel_modules():
    assert offenders() == [], "import these through cat_fast.ops (e.g. cat_fast.ops.fused) instead"


def test_the_check_sees_relative_and_absolute_imports(tmp_path):
    (tmp_path / "layers").mkdir()
    (tmp_path / "ops").mkdir()
    (tmp_path / "layers" / "a.py").write_text("from ..kernels.triton import optional\nimport cat_fast._C\n")
    (tmp_path / "layers" / "b.py").write_text("from ..ops.fused import fused_kernels\n")
    (tmp_path / "ops" / "c.py").write_text("from ..kernels import reference\n")
    assert offenders(tmp_path) == ["layers/a.py: cat_fast.kernels.triton",
                                   "layers/a.py: cat_fast.kernels.triton.optional", "layers/a.py: cat_fast._C"]
