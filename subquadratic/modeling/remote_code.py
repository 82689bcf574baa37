"""Write the model code next to a checkpoint so that `trust_remote_code=True` loads it where the
package is not installed.

A Hub user finds the files Transformers' own remote-code models have: `configuration_<model_type>.py`
(the family's config module) and `modeling_<model_type>.py` (the module of its model classes, which
also registers the family's mixers when it runs as remote code; the configuration file has the
registry load it before a config checks its mixer names), and config.json's `auto_map` points at
them. Every other module of the package they import travels in one of two support files
(`SUPPORT_FILES`): `subquadratic_support.py`, the modules the two files need on any device, and
`subquadratic_triton.py`, the Triton kernels' modules (those that import Triton when they load, and
what imports them), which the support file imports only inside the functions that launch a kernel,
as the package does. Each support file holds its modules whole, in the order their top-level imports
need, each under a header naming it, with their imports of each other rewritten: an import of a
module in the same file goes, an import of another file names that file.
Where two modules of one file bind the same top-level name to different things, each binding of the
name is renamed `<name>__<module>` and every use of it in its module follows (uses are resolved by
scope: parameters, locals and attributes of that name keep it); a module that reads its own names
from strings (`globals()`, `exec`, `eval`) keeps its names, and two such modules binding one name
are refused, as are import cycles between modules of one file and a module without
`from __future__ import annotations` (which the merged file turns on for every module); a merged file
that would read a name it does not bind is refused too (`_check_defined`). Package
modules import each other relatively; a family declared outside the package may import the package
absolutely (`from subquadratic.x import y`). Everything comes from the family's registration
(`registry.Family`).
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import re
import symtable
from dataclasses import dataclass, field
from pathlib import Path

from ..registry import Family, family_of_model_type

PACKAGE = "subquadratic"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
#: The support files' stems: the modules every device needs, and the Triton kernels' modules.
SUPPORT, TRITON = "subquadratic_support", "subquadratic_triton"
SUPPORT_FILES = (f"{SUPPORT}.py", f"{TRITON}.py")


def flat_name(module: str) -> str:
    """A module's dotted path with underscores (`subquadratic.kernels.utils` -> `subquadratic_kernels_utils`),
    the suffix of its renamed names."""
    return "_".join(p for p in module.split(".") if p != "__init__")


def entry_names(family: Family) -> dict[str, str]:
    """module -> file stem of the two files a Hub user opens: the model classes' module as
    `modeling_<model_type>`, the config class's as `configuration_<model_type>` (when it is another
    module; else `configuration_<model_type>` is generated, re-exporting the config class)."""
    names = {family.causal_lm_class.__module__: f"modeling_{family.model_type}"}
    names.setdefault(family.config_class.__module__, f"configuration_{family.model_type}")
    return names


@dataclass
class _Import:
    """One `from <package module> import ...` statement of a module."""

    node: ast.ImportFrom
    target: str  # the module imported from
    names: list[tuple[str, str]]  # (name in the target, name bound here)
    lazy: bool  # inside a function: runs when the function does
    top: bool  # a statement of the module's body itself (not inside an if / try)


@dataclass
class _Module:
    name: str
    path: Path
    text: str
    tree: ast.Module
    is_pkg: bool
    imports: list[_Import] = field(default_factory=list)

    @property
    def eager(self) -> set[str]:
        return {i.target for i in self.imports if not i.lazy}


def _source(module: str) -> tuple[Path, bool]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"cannot bundle module {module!r}: no Python source found")
    return Path(spec.origin), spec.submodule_search_locations is not None


def _read(module: str) -> _Module:
    """A module's source and its imports of the package (relative, or absolute from outside it)."""
    path, is_pkg = _source(module)
    text = path.read_text()
    tree = ast.parse(text, str(path))
    package = module.split(".") if is_pkg else module.split(".")[:-1]
    external = module.split(".")[0] != PACKAGE
    mod = _Module(module, path, text, tree, is_pkg)

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and (child.level or (external and child.module
                                                                       and child.module.split(".")[0] == PACKAGE)):
                if not child.module:
                    raise ValueError(f"{path}: use 'from .module import name', not 'from . import module'")
                base = package[: len(package) - (child.level - 1)] if child.level > 1 else package
                target = ".".join(base + child.module.split(".")) if child.level else child.module
                if target == PACKAGE:
                    raise ValueError(f"{path}: import from the package's modules (subquadratic.modeling.base, ...), "
                                     "not from the package itself, so that the code can travel as remote code")
                if any(a.name == "*" for a in child.names):
                    raise ValueError(f"{path}: 'from {child.module} import *' cannot travel as remote code; "
                                     "name what is imported")
                mod.imports.append(_Import(child, target, [(a.name, a.asname or a.name) for a in child.names],
                                           lazy, node is tree))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            else:
                visit(child, lazy)

    visit(tree, False)
    return mod


def _loads_triton(mod: _Module) -> bool:
    """Whether the module imports Triton when it loads: `import triton` / `from triton ...` or a call of
    `import_triton()` outside its functions."""
    def walk(node: ast.AST):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                yield child
                yield from walk(child)
    for node in walk(mod.tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "triton":
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "import_triton":
            return True
    return False


def _topological(group: list[str], modules: dict[str, _Module], where: str) -> list[str]:
    """The group's modules, each after the modules of the group it imports at load time."""
    done: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, chain: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join(chain[chain.index(name):] + [name])
            raise ValueError(f"cannot merge the modules of {where}: they import each other when they load ({cycle}); "
                             "move one of the imports into the function that needs it")
        state[name] = 1
        for dep in sorted(modules[name].eager & set(group)):
            visit(dep, chain + [name])
        state[name] = 2
        done.append(name)

    for name in sorted(group):
        visit(name, [])
    return done


# ---------------------------------------------------------------------------------------------- names


def _bindings(mod: _Module, package_imports: set[int]) -> dict[str, list[ast.AST]]:
    """The module's top-level names -> the statements binding them (its package imports left out),
    names declared `global` in its functions included."""
    out: dict[str, list[ast.AST]] = {}

    def bind(name: str, stmt: ast.AST) -> None:
        out.setdefault(name, []).append(stmt)

    def targets(node: ast.AST, stmt: ast.AST) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                bind(n.id, stmt)

    def body(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(s.name, s)
                for n in ast.walk(s):
                    if isinstance(n, ast.Global):
                        for g in n.names:
                            bind(g, n)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                if id(s) not in package_imports:
                    for a in s.names:
                        bind(a.asname or a.name.split(".")[0], s)
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                    targets(t, s)
                for n in ast.walk(s.value) if s.value else ():
                    if isinstance(n, ast.NamedExpr):
                        bind(n.target.id, s)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                targets(s.target, s)
                body(s.body), body(s.orelse)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars, s)
                body(s.body)
            elif isinstance(s, ast.If):
                body(s.body), body(s.orelse)
            elif isinstance(s, ast.Try):
                body(s.body), body(s.orelse), body(s.finalbody)
                for h in s.handlers:
                    if h.name:
                        bind(h.name, h)
                    body(h.body)
            elif isinstance(s, ast.Delete):
                for t in s.targets:
                    targets(t, s)
            else:
                for n in ast.walk(s):
                    if isinstance(n, ast.NamedExpr):
                        bind(n.target.id, s)

    body(mod.tree.body)
    return out


def _scope_bound(node: ast.AST) -> set[str]:
    """The names a function, lambda, comprehension or class body binds in its own scope (not those it
    declares global or nonlocal)."""
    bound: set[str] = set()
    declared: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                bound.add(arg.arg)
        inner = node.body if isinstance(node.body, list) else [node.body]
    elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        for g in node.generators:
            for n in ast.walk(g.target):
                if isinstance(n, ast.Name):
                    bound.add(n.id)
        return bound
    else:  # a class body
        inner = node.body

    def walk(n: ast.AST) -> None:
        for c in ast.iter_child_nodes(n):
            if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(c.name)
                for d in c.decorator_list:
                    walk(d)
                if not isinstance(c, ast.ClassDef):
                    for d in [*c.args.defaults, *c.args.kw_defaults]:
                        if d is not None:
                            walk(d)
                else:
                    for b in [*c.bases, *c.keywords]:
                        walk(b)
                continue
            if isinstance(c, ast.Lambda):
                for d in [*c.args.defaults, *c.args.kw_defaults]:
                    if d is not None:
                        walk(d)
                continue
            if isinstance(c, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                for n2 in ast.walk(c):  # a walrus in a comprehension binds in the enclosing function
                    if isinstance(n2, ast.NamedExpr):
                        bound.add(n2.target.id)
                walk(c.generators[0].iter)
                continue
            if isinstance(c, (ast.Global, ast.Nonlocal)):
                declared.update(c.names)
            elif isinstance(c, ast.Name) and isinstance(c.ctx, (ast.Store, ast.Del)):
                bound.add(c.id)
            elif isinstance(c, (ast.Import, ast.ImportFrom)):
                for a in c.names:
                    bound.add(a.asname or a.name.split(".")[0])
            elif isinstance(c, ast.ExceptHandler) and c.name:
                bound.add(c.name)
            elif isinstance(c, ast.MatchAs) and c.name:
                bound.add(c.name)
            walk(c)

    for s in inner:
        walk(s) if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else walk(
            ast.Module(body=[s], type_ignores=[]))
    return bound - declared


def _global_uses(tree: ast.Module) -> list[ast.AST]:
    """Every `Name` node of the module that refers to a module-level name (by Python's scoping rules:
    a class body's names are not seen by the functions inside it), and every `global` statement."""
    out: list[ast.AST] = []

    def check(name: ast.Name, scopes: list[tuple[str, set[str]]]) -> None:
        for i, (kind, bound) in enumerate(reversed(scopes)):
            if kind == "class" and i > 0:
                continue
            if name.id in bound:
                return
        out.append(name)

    def function_head(c: ast.AST, scopes) -> None:
        for d in [*getattr(c, "decorator_list", []), *c.args.defaults, *c.args.kw_defaults]:
            if d is not None:
                visit(d, scopes)
        for arg in [*c.args.posonlyargs, *c.args.args, *c.args.kwonlyargs, c.args.vararg, c.args.kwarg]:
            if arg is not None and arg.annotation is not None:
                visit(arg.annotation, scopes)
        if getattr(c, "returns", None) is not None:
            visit(c.returns, scopes)

    def visit(node: ast.AST, scopes: list[tuple[str, set[str]]]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function_head(node, scopes)
            inner = scopes + [("function", _scope_bound(node))]
            for s in node.body:
                visit(s, inner)
        elif isinstance(node, ast.Lambda):
            function_head(node, scopes)
            visit(node.body, scopes + [("function", _scope_bound(node))])
        elif isinstance(node, ast.ClassDef):
            for d in [*node.decorator_list, *node.bases, *node.keywords]:
                visit(d, scopes)
            inner = scopes + [("class", _scope_bound(node))]
            for s in node.body:
                visit(s, inner)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            visit(node.generators[0].iter, scopes)  # evaluated in the enclosing scope
            inner = scopes + [("function", _scope_bound(node))]
            for i, g in enumerate(node.generators):
                for part in [g.target, *([g.iter] if i else []), *g.ifs]:
                    visit(part, inner)
            for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
                visit(part, inner)
        elif isinstance(node, ast.Name):
            check(node, scopes)
        elif isinstance(node, ast.Global):
            out.append(node)
        else:
            for c in ast.iter_child_nodes(node):
                visit(c, scopes)

    visit(tree, [])
    return out


# ---------------------------------------------------------------------------------------------- merging


@dataclass
class _Plan:
    """Where each module goes and what each of its top-level names is called there."""

    file_of: dict[str, str]  # module -> file stem
    names: dict[tuple[str, str], str] = field(default_factory=dict)  # (module, name) -> its name in its file
    aliases: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)  # module -> bound -> (target, name)

    def resolve(self, module: str, name: str) -> tuple[str, str]:
        """The (module, name) that defines what `name` is in `module`, through its package imports."""
        seen = set()
        while name in self.aliases.get(module, {}) and (module, name) not in seen:
            seen.add((module, name))
            module, name = self.aliases[module][name]
        return module, name

    def global_name(self, module: str, name: str) -> str:
        return self.names.get((module, name), name)


def _external_import(stmt: ast.AST, name: str) -> tuple | None:
    """What an import of another package binds `name` to: (module, attribute) or (module,)."""
    if isinstance(stmt, ast.ImportFrom) and not stmt.level:
        return next(((stmt.module, a.name) for a in stmt.names if (a.asname or a.name) == name), None)
    if isinstance(stmt, ast.Import):
        for a in stmt.names:
            if a.asname == name:
                return (a.name,)
            if not a.asname and a.name.split(".")[0] == name:
                return (name,)
    return None


def _benign(stmts: list[ast.AST], name: str, mods: list[str], plan: _Plan) -> bool:
    """Whether the statements (one per module) binding a name bind it to the same thing: the same object
    of another package, or by the same statement: a literal, or a call without arguments of the same
    function."""
    imported = {_external_import(s, name) for s in stmts}
    if len(imported) == 1 and None not in imported:
        return True
    def key(s: ast.AST):  # (where the name sits in the target, the value)
        if not isinstance(s, ast.Assign) or len(s.targets) != 1:
            return None
        t = s.targets[0]
        if isinstance(t, ast.Name):
            return (None, ast.dump(s.value))
        if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts):
            return ([e.id for e in t.elts].index(name), len(t.elts), ast.dump(s.value))
        return None

    keys = {key(s) for s in stmts}
    if len(keys) != 1 or None in keys:
        return False
    v = stmts[0].value
    try:
        ast.literal_eval(v)
        return True
    except ValueError:
        pass
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and not v.args and not v.keywords:
        return all(v.func.id in plan.aliases.get(m, {}) for m in mods) and \
            len({plan.resolve(m, v.func.id) for m in mods}) == 1
    return False


def _reads_names_from_strings(tree: ast.Module) -> bool:
    """Whether the module reads its own names from strings: `exec`, `eval`, `globals()` or `vars()`."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            if n.func.id in ("exec", "eval") or (n.func.id in ("globals", "vars") and not n.args):
                return True
    return False


def _rename(mods: list[str], modules: dict[str, _Module], plan: _Plan, where: str) -> None:
    """Give every top-level name of the file's modules its name in the file (`plan.names`)."""
    binds = {m: _bindings(modules[m], {id(i.node) for i in modules[m].imports}) for m in mods}
    pinned = {m for m in mods if _reads_names_from_strings(modules[m].tree)}
    by_name: dict[str, list[str]] = {}
    for m in mods:
        for name in binds[m]:
            by_name.setdefault(name, []).append(m)
        for imp in modules[m].imports:  # names bound by imports from another file
            if not imp.lazy and plan.file_of.get(imp.target) != plan.file_of[m]:
                for _, bound in imp.names:
                    by_name.setdefault(bound, []).append(m)
    taken = set(by_name)
    for name, owners in sorted(by_name.items()):
        owners = list(dict.fromkeys(owners))
        if len(owners) < 2 or name == "__all__":
            continue
        if all(name in plan.aliases.get(m, {}) for m in owners) and len({plan.resolve(m, name)
                                                                             for m in owners}) == 1:
            continue  # the same import in each
        if all(name in binds[m] and len(binds[m][name]) == 1 for m in owners) and \
                _benign([binds[m][name][0] for m in owners], name, owners, plan):
            continue
        keep = [m for m in owners if m in pinned]
        if len(keep) > 1:
            raise ValueError(f"cannot merge {' and '.join(keep)} into {where}: both bind {name!r} and read their "
                             "names from strings (globals(), exec or eval), so neither can be renamed; rename one")
        for m in owners:
            if m not in keep:
                new = f"{name}__{flat_name(m).removeprefix(PACKAGE + '_')}"
                if new in taken:
                    raise ValueError(f"cannot merge {m} into {where}: renaming {name!r} to {new!r} meets a name "
                                     "already there; rename one of them")
                taken.add(new)
                plan.names[(m, name)] = new


def _import_line(file: str, pairs: list[tuple[str, str]], indent: str = "") -> str:
    """`from .<file> import a as b, ...` for (name in that file, name bound here) pairs."""
    parts = [a if a == b else f"{a} as {b}" for a, b in pairs]
    return f"{indent}from .{file} import {', '.join(parts)}"


def _rewrite(mod: _Module, plan: _Plan, merged: bool) -> str:
    """The module's source with its package imports pointing at the bundle's files and, when it is merged
    with others (`merged`), its top-level names renamed where `plan` says and the imports of modules in
    its own file gone (`from __future__ import annotations` and `__all__` go too: the file has its own)."""
    here = plan.file_of[mod.name]
    lines = mod.text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    offset = lambda line, col: starts[line - 1] + len(lines[line - 1].encode()[:col].decode())  # noqa: E731
    edits: list[tuple[int, int, str]] = []

    def span(node: ast.AST) -> tuple[int, int]:
        return offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset)

    def whole_line(b: int) -> int:  # past the newline ending the statement at b, if only it is on its line
        end = mod.text.find("\n", b) % (len(mod.text) + 1)
        return min(end + 1, len(mod.text)) if not mod.text[b:end].strip() else b

    rename: dict[str, str] = {}  # this module's name -> its name in the file (uses of names it imports included)
    for imp in mod.imports:
        pairs = []
        for name, bound in imp.names:
            dm, dn = plan.resolve(imp.target, name)
            where = plan.file_of[dm]
            if imp.lazy or not merged:
                pairs.append((where, plan.global_name(dm, dn), bound))
            elif where == here:
                rename[bound] = plan.global_name(dm, dn)
            else:
                pairs.append((where, plan.global_name(dm, dn), plan.global_name(mod.name, bound)))
                if plan.global_name(mod.name, bound) != bound:
                    rename[bound] = plan.global_name(mod.name, bound)
        indent = " " * imp.node.col_offset
        text = "\n".join(_import_line(f, [(a, b) for f2, a, b in pairs if f2 == f], indent if i else "")
                         for i, f in enumerate(dict.fromkeys(f for f, _, _ in pairs)))
        a, b = span(imp.node)
        end = mod.text.find("\n", b) % (len(mod.text) + 1)
        rest = mod.text[b:end].strip()
        if not text and imp.top and (not rest or rest.startswith("#")):
            b = min(end + 1, len(mod.text))  # the statement's line goes, with a comment after it
        edits.append((a, b, text or ("" if imp.top else "pass")))
    if merged:
        for name in {n for (m, n) in plan.names if m == mod.name}:
            rename[name] = plan.names[(mod.name, name)]
        for s in mod.tree.body:
            if isinstance(s, ast.ImportFrom) and s.module == "__future__":
                if [a.name for a in s.names] != ["annotations"]:
                    raise ValueError(f"{mod.path}: only `from __future__ import annotations` can be merged")
                edits.append((span(s)[0], whole_line(span(s)[1]), ""))
            elif isinstance(s, (ast.Assign, ast.AnnAssign)) and any(
                    isinstance(t, ast.Name) and t.id == "__all__"
                    for t in (s.targets if isinstance(s, ast.Assign) else [s.target])):
                edits.append((span(s)[0], whole_line(span(s)[1]), ""))
        if not any(isinstance(s, ast.ImportFrom) and s.module == "__future__" for s in mod.tree.body):
            raise ValueError(f"{mod.path}: merging it into {here}.py turns on `from __future__ import annotations`, "
                             "which it lacks; add it to the module")
        for s in _top_level_statements(mod.tree):
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name in rename:
                a = offset(s.lineno, s.col_offset)
                m = re.compile(r"(?:async\s+)?(?:def|class)\s+").match(mod.text, a)
                if m is None or not mod.text.startswith(s.name, m.end()):
                    raise ValueError(f"{mod.path}:{s.lineno}: cannot find the name of {s.name!r} to rename it")
                edits.append((m.end(), m.end() + len(s.name), rename[s.name]))
            elif isinstance(s, (ast.Import, ast.ImportFrom)) and getattr(s, "module", "") != "__future__" and \
                    id(s) not in {id(i.node) for i in mod.imports}:
                for al in s.names:
                    bound = al.asname or al.name
                    if bound in rename:
                        if isinstance(s, ast.Import) and not al.asname and "." in al.name:
                            raise ValueError(f"{mod.path}:{s.lineno}: write 'import {al.name} as ...' so that "
                                             f"{bound!r} can be renamed")
                        edits.append((*span(al), f"{al.name} as {rename[bound]}"))
        inside_imports = [span(i.node) for i in mod.imports]
        for node in _global_uses(mod.tree):
            if isinstance(node, ast.Global):
                if any(n in rename for n in node.names):
                    edits.append((*span(node), "global " + ", ".join(rename.get(n, n) for n in node.names)))
                continue
            new = rename.get(node.id)
            if new is None or new == node.id:
                continue
            a, b = span(node)
            if any(s <= a < e for s, e in inside_imports):
                continue
            if mod.text[a:b] != node.id:
                raise ValueError(f"{mod.path}:{node.lineno}: cannot rename {node.id!r} here (inside an f-string?); "
                                 "rename it in the module")
            edits.append((a, b, new))
    text = mod.text
    for a, b, new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    return text


def _top_level_statements(tree: ast.Module):
    """The statements that run when the module loads: its body, and the blocks of its ifs, trys, withs
    and loops, not function or class bodies."""
    todo = list(tree.body)
    while todo:
        s = todo.pop(0)
        yield s
        if isinstance(s, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
            for part in ("body", "orelse", "finalbody"):
                todo.extend(getattr(s, part, []))
            for h in getattr(s, "handlers", []):
                todo.extend(h.body)


def _check_defined(text: str, file: str) -> None:
    """Every name the merged file reads as a global is bound at its top level (or a builtin)."""
    table = symtable.symtable(text, file, "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins)) | {"__name__", "__file__", "__doc__", "__spec__", "__package__", "__loader__",
                                     "__builtins__", "__annotations__"}
    used: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            if s.is_declared_global() and s.is_assigned():
                defined.add(s.get_name())
            if (t.get_type() == "module" and s.is_referenced()) or (t.get_type() != "module" and s.is_global()):
                used.add(s.get_name())
        for c in t.get_children():
            walk(c)

    walk(table)
    missing = sorted(used - defined)
    if missing:
        raise ValueError(f"merging the modules into {file} left {', '.join(missing)} undefined")


def bundle_sources(family: Family) -> dict[str, str]:
    """File name -> source: `configuration_<model_type>.py`, `modeling_<model_type>.py` and the support
    files (`SUPPORT_FILES`, those the family needs) holding every module they import from the package (or,
    relatively, from their own package)."""
    classes = [family.config_class, family.model_class, family.causal_lm_class, *family.mixers.values()]
    entries = entry_names(family)
    modules: dict[str, _Module] = {}
    todo = sorted({cls.__module__ for cls in classes} | set(entries))
    while todo:
        name = todo.pop()
        if name not in modules:
            modules[name] = _read(name)
            todo.extend(i.target for i in modules[name].imports)
    triton_loaders = {m for m in modules if _loads_triton(modules[m])}
    # a module goes with the Triton kernels when it, or a module it imports when it loads, imports Triton
    triton = set(triton_loaders)
    changed = True
    while changed:
        changed = False
        for m, mod in modules.items():
            if m not in triton and mod.eager & triton:
                triton.add(m)
                changed = True
    for m in entries:
        if m in triton:
            raise ValueError(f"{m} imports Triton when it loads; import the Triton kernels inside the functions "
                             "that launch them, so that the model loads where Triton is not installed")
    plan = _Plan({m: entries.get(m) or (TRITON if m in triton else SUPPORT) for m in modules})
    for m, mod in modules.items():
        plan.aliases[m] = {bound: (i.target, name) for i in mod.imports if not i.lazy for name, bound in i.names}
    for m, mod in modules.items():
        if m not in entries:
            for dep in mod.eager & set(entries):
                raise ValueError(f"{m} imports {dep} when it loads; the model's own modules import the shared "
                                 "ones, not the other way round")
    out: dict[str, str] = {}
    for stem in (SUPPORT, TRITON):
        group = [m for m in modules if plan.file_of[m] == stem]
        if not group:
            continue
        order = _topological(group, modules, f"{stem}.py")
        _rename(order, modules, plan, f"{stem}.py")
        what = "the Triton kernels, imported where a kernel launches" if stem == TRITON else "those of every device"
        parts = [f'"""The {PACKAGE} modules that `configuration_*.py` and `modeling_*.py` use ({what}), merged\n'
                 'into one file: each section below is one module of the package, named in its header."""\n\n'
                 "from __future__ import annotations\n"]
        for m in order:
            rel = m.replace(".", "/") + ("/__init__.py" if modules[m].is_pkg else ".py")
            parts.append(f"\n\n# {'-' * 96}\n# {rel}\n\n" + _rewrite(modules[m], plan, merged=True).strip("\n")
                         + "\n")
        text = "".join(parts)
        _check_defined(text, f"{stem}.py")
        out[f"{stem}.py"] = text
    for m, stem in entries.items():
        out[f"{stem}.py"] = _rewrite(modules[m], plan, merged=False)
    modeling = f"modeling_{family.model_type}.py"
    out[modeling] += _registration(family, plan)
    configuration = f"configuration_{family.model_type}.py"
    if configuration in out:
        out[configuration] += _deferred_registration(family, plan)
    else:  # the config class lives in the modeling module
        cls = family.config_class
        out[configuration] = (f'"""The {family.name} family\'s configuration (defined in {modeling})."""\n\n'
                              f"from .modeling_{family.model_type} import {cls.__name__}\n\n"
                              f"__all__ = [{cls.__name__!r}]\n")
    return out


def _registry_import(plan: _Plan, name: str) -> str:
    module = f"{PACKAGE}.registry"
    if module not in plan.file_of:
        raise ValueError(f"the family's modules do not import {module}; remote code needs it to register the mixers")
    return _import_line(plan.file_of[module], [(plan.global_name(module, name), name)])


def _deferred_registration(family: Family, plan: _Plan) -> str:
    """What the configuration file ends with: the modeling file loaded (registering the mixers) before
    the registry is first read, as a config checks its `mixer_types` there. The import sits in a
    function (the modeling file imports this one), where Transformers' loader still finds it and
    copies the modeling file along."""
    return "\n".join([
        "", "",
        "def _register_mixers() -> None:",
        '    """Remote code: the modeling file registers the mixers a config names, before they are read."""',
        f"    from .modeling_{family.model_type} import {family.causal_lm_class.__name__}  # noqa: F401",
        "",
        "",
        f"{_registry_import(plan, 'load_with')}  # noqa: E402",
        "",
        "load_with(_register_mixers)",
    ]) + "\n"


def _registration(family: Family, plan: _Plan) -> str:
    """What the modeling file ends with: the family's mixers registered under the names its configs'
    `mixer_types` use (the package registers them itself; remote code has only this file)."""
    lines = ["", "", "# Remote code: the family's mixers, registered under the names config.mixer_types uses.",
             f"{_registry_import(plan, 'register_mixer')}  # noqa: E402"]
    for cls in dict.fromkeys(family.mixers.values()):
        if cls.__module__ != family.causal_lm_class.__module__:
            m, n = plan.resolve(cls.__module__, cls.__name__)
            lines.append(f"{_import_line(plan.file_of[m], [(plan.global_name(m, n), cls.__name__)])}"
                         "  # noqa: E402")
    lines += [f"register_mixer({name!r}, {cls.__name__})" for name, cls in family.mixers.items()]
    return "\n".join(lines) + "\n"


def write_remote_code(folder: str | Path, model_type: str) -> None:
    """Write the model code (`bundle_sources`) into `folder` and point its config.json's `auto_map` at
    `configuration_<model_type>.py` and `modeling_<model_type>.py`."""
    folder = Path(folder)
    try:
        family = family_of_model_type(model_type)
    except KeyError as e:
        raise ValueError(f"no remote code for model_type {model_type!r}: {e.args[0]}") from None
    for name, text in bundle_sources(family).items():
        (folder / name).write_text(text)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    modeling = f"modeling_{family.model_type}"
    cfg["auto_map"] = {
        "AutoConfig": f"configuration_{family.model_type}.{family.config_class.__name__}",
        "AutoModel": f"{modeling}.{family.model_class.__name__}",
        "AutoModelForCausalLM": f"{modeling}.{family.causal_lm_class.__name__}",
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
