"""The remote code a checkpoint carries (`modeling.remote_code`): a few files a Hub user recognises,
its modules merged into support files with colliding top-level names renamed (and a merge that cannot
rename refused in one error), and the Triton kernels of the merged file running as the package's do.
The bare-environment load and generation of every family are `test_remote_code_without_the_package`
(tests/models/common.py) and tests/test_load_without_package.py."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from subquadratic.modeling.remote_code import SUPPORT_FILES, bundle_sources
from subquadratic.registry import family_of_model_type


def write_package(files: dict[str, str], root: Path, name: str) -> str:
    """The files as an importable package `name` under `root` (as Transformers' loader makes them)."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for file, text in files.items():
        (pkg / file).write_text(text)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    return name


@pytest.fixture
def clean_path():
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name.startswith(("rcfam", "rcout", "rcbundle")):
            del sys.modules[name]


@pytest.mark.parametrize("model_type", ["spla", "sse", "hla"])
def test_each_family_travels_as_configuration_modeling_and_two_support_files(model_type):
    files = bundle_sources(family_of_model_type(model_type))
    assert set(files) == {f"configuration_{model_type}.py", f"modeling_{model_type}.py", *SUPPORT_FILES}
    for text in files.values():
        ast.parse(text)
        assert text.count("from __future__ import annotations") <= 1
    support, kernels = (files[f] for f in SUPPORT_FILES)
    # every module section is named, and only the Triton file imports Triton when it loads
    assert "# subquadratic/registry.py" in support and "# subquadratic/kernels/triton_launch.py" in kernels
    assert "= import_triton()" not in "\n".join(ln for ln in support.splitlines() if not ln.startswith(" "))
    assert "= import_triton()" in "\n".join(ln for ln in kernels.splitlines() if not ln.startswith(" "))


FAMILY = {
    "__init__.py": "",
    "a.py": '''
        """Module a."""
        from __future__ import annotations

        SCALE = 2
        LIMIT = 8  # the same literal as b's: one binding serves both


        def helper(x):
            return x * SCALE


        def _private():
            return f"a{SCALE}"
    ''',
    "b.py": '''
        """Module b."""
        from __future__ import annotations

        from subquadratic.registry import register_mixer  # noqa: F401

        SCALE = 3
        LIMIT = 8


        def helper(x, SCALE=10):  # the parameter keeps its name
            return x + SCALE


        def _private():
            return "b"


        class Holder:
            SCALE = 100

            def get(self):
                return SCALE, self.SCALE, [SCALE for SCALE in range(2)]


        def uses():
            from .a import helper as lazy_helper

            return helper(1), _private(), Holder().get(), lazy_helper(5), LIMIT
    ''',
    "modeling.py": '''
        from __future__ import annotations

        from .a import _private as private_a
        from .a import helper as helper_a
        from .b import helper, uses


        class Config:
            pass


        class Model:
            pass


        class ForCausalLM:
            @staticmethod
            def check():
                return helper_a(1), private_a(), helper(1), uses()
    ''',
}


def fake_family(root: Path, package: str, files: dict[str, str]) -> SimpleNamespace:
    write_package({f: textwrap.dedent(t).lstrip("\n") for f, t in files.items() if f != "__init__.py"}, root, package)
    modeling = importlib.import_module(f"{package}.modeling")
    return SimpleNamespace(config_class=modeling.Config, model_class=modeling.Model,
                           causal_lm_class=modeling.ForCausalLM, mixers={}, model_type="rcfam", name="rcfam")


def test_colliding_names_are_renamed_by_scope_and_the_merged_code_computes_the_same(tmp_path, clean_path):
    family = fake_family(tmp_path / "src", "rcfam", FAMILY)
    want = family.causal_lm_class.check()
    assert want == (2, "a2", 11, (11, "b", (3, 100, [0, 1]), 10, 8))
    files = bundle_sources(family)
    assert set(files) == {"configuration_rcfam.py", "modeling_rcfam.py", "subquadratic_support.py"}
    support = files["subquadratic_support.py"]
    assert "SCALE__rcfam_a = 2" in support and "SCALE__rcfam_b = 3" in support
    assert "def helper(" not in support
    assert "def helper__rcfam_b(x, SCALE=10):  # the parameter keeps its name\n    return x + SCALE" in support
    assert support.count("LIMIT = 8") == 2 and "LIMIT__" not in support
    assert "from .subquadratic_support import helper__rcfam_a as lazy_helper" in support
    assert "from .subquadratic_support import _private__rcfam_a as private_a" in files["modeling_rcfam.py"]
    write_package(files, tmp_path / "out", "rcout")
    assert importlib.import_module("rcout.modeling_rcfam").ForCausalLM.check() == want


def test_a_merge_that_cannot_rename_is_refused_in_one_error(tmp_path, clean_path):
    files = dict(FAMILY)
    for name in ("a.py", "b.py"):  # both read their names from strings: neither may be renamed
        files[name] = files[name] + "\n\n        def lookup(name):\n            return globals()[name]\n"
    family = fake_family(tmp_path / "src", "rcfam", files)
    with pytest.raises(ValueError, match=r"cannot merge rcfam\.a and rcfam\.b into subquadratic_support\.py: both bind "
                                         r"'SCALE' and read their names from strings"):
        bundle_sources(family)


def test_an_import_cycle_between_merged_modules_is_refused(tmp_path, clean_path):
    files = dict(FAMILY)
    files["a.py"] = files["a.py"].replace("SCALE = 2\n", "SCALE = 2\n\n        from .b import uses  # noqa: E402\n")
    files["b.py"] = files["b.py"].replace("        from subquadratic",
                                          "        from .a import SCALE as A_SCALE  # noqa\n        from subquadratic")
    family = fake_family(tmp_path / "src", "rcfam", files)
    with pytest.raises(ValueError, match=r"they import each other when they load \(rcfam\.a -> rcfam\.b -> rcfam\.a\)"):
        bundle_sources(family)


def test_a_merged_file_reading_a_name_it_does_not_bind_is_refused():
    from subquadratic.modeling.remote_code import _check_defined

    _check_defined("import torch\nX = 1\n\n\ndef f(y, n=X):\n    return torch, y, [X for X in range(n)]\n", "ok.py")
    with pytest.raises(ValueError, match=r"merging the modules into m\.py left helper__a undefined"):
        _check_defined("def f(x):\n    return helper__a(x)\n", "m.py")


def jit_functions(module) -> list:
    """The Python functions of a module's Triton kernels (under their jit / autotune / heuristics wrappers,
    or the interpreter's)."""
    out = []
    for value in vars(module).values():
        wrapped = False
        while not inspect.isfunction(value) and hasattr(value, "fn"):
            wrapped = wrapped or type(value).__module__.startswith("triton")
            value = value.fn
        if wrapped and inspect.isfunction(value) and value not in out:
            out.append(value)
    return out


@pytest.mark.parametrize("model_type", ["spla", "sse", "hla"])
def test_the_merged_triton_kernels_resolve_every_name_and_run_as_the_packages(model_type, tmp_path, clean_path):
    pytest.importorskip("triton")
    files = bundle_sources(family_of_model_type(model_type))
    write_package(files, tmp_path, f"rcbundle_{model_type}")
    kernels = importlib.import_module(f"rcbundle_{model_type}.subquadratic_triton")
    support = importlib.import_module(f"rcbundle_{model_type}.subquadratic_support")
    jits = jit_functions(kernels)
    assert len(jits) >= 10
    for fn in jits:  # the source Triton compiles (read as it reads it), and each global it reads
        assert Path(fn.__code__.co_filename).name == "subquadratic_triton.py"
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        func = tree.body[0]
        local = {a.arg for a in ast.walk(func) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(func):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
                assert n.id in fn.__globals__ or hasattr(builtins, n.id), (fn.__name__, n.id)
    # the norm-gate kernels (which call the RMSNorm kernels' jit function) in the interpreter, forward and
    # backward, against the package's own
    from subquadratic.kernels.norm_gate import norm_gate

    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 5, 3, 32, generator=g), torch.randn(2, 5, 3, 32, generator=g)
    w = 1 + 0.1 * torch.randn(3, 32, generator=g)
    outs = []
    for fn in (support.norm_gate, norm_gate):
        args = [t.clone().requires_grad_(True) for t in (x, w, gate)]
        y = fn(*args, 1e-6, backend="triton")
        y.square().sum().backward()
        outs.append([y.detach(), *(a.grad for a in args)])
    for got, want in zip(*outs, strict=True):
        assert torch.equal(got, want)


def test_spla_from_the_remote_code_trains_on_the_block_kernels_as_the_packages(tmp_path, monkeypatch, one_thread,
                                                                              clean_path):
    """A tiny SPLA model past its budget, loaded through the classes of its folder's model code, planned as on
    CUDA and run in Triton's interpreter: the block-major kernels of `subquadratic_triton.py` give the loss and
    gradients of the package's own model on the same plan."""
    pytest.importorskip("triton")
    from subquadratic.kernels import spla as spla_kernels
    from tests.models.spla.tiny import tiny_spla

    model = tiny_spla(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1).train()
    model.save_pretrained(tmp_path / "spla")
    files = {p.name: p.read_text() for p in (tmp_path / "spla").glob("*.py")}
    package = write_package(files, tmp_path / "code", "rcbundle_train")
    remote_cls = importlib.import_module(f"{package}.modeling_spla").SPLAForCausalLM
    remote = remote_cls.from_pretrained(tmp_path / "spla").train()
    support = sys.modules[f"{package}.subquadratic_support"]
    plans = []

    def on_cuda(real):
        def plan(q_shape, k_shape, dtype, device, params, **kw):
            kw.update(backend="triton", precision="ieee")
            plans.append(real(q_shape, k_shape, dtype, "cuda", params, **kw))
            return plans[-1]
        return plan

    monkeypatch.setattr(spla_kernels, "plan_spla", on_cuda(spla_kernels.plan_spla))
    monkeypatch.setattr(support, "plan_spla", on_cuda(support.plan_spla))
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for m in (model, remote):
        m.zero_grad()
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert len(plans) == 4 and f"{package}.subquadratic_triton" in sys.modules  # two SPLA layers, each model
    assert type(remote).__module__ == f"{package}.modeling_spla"
    assert type(plans[2]).__module__ == support.__name__
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
    assert results[1][1].keys() == results[0][1].keys()
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-7, msg=name)
