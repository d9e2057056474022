"""The import graph of the installed packages: no circles, no import from a lower layer to a higher one.

Every import counts, those inside functions too. Modules are named as they install (pyproject's
package-dir: experiments/ is mlra_jax.experiments, pallas_kernels/ is mlra_jax.pallas_kernels).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: a module imports from its own layer or lower ones. A module belongs to the layer of
# its longest matching prefix.
LAYERS = (
    ("registry", ("mlra_jax.variants",)),
    ("config", ("mlra_jax.config",)),
    ("kernels", ("mlra_jax.pallas_kernels",)),
    ("library", ("mlra_jax",)),
    ("experiments", ("mlra_jax.experiments",)),
    (
        "entry points",
        (
            "mlra_jax.train",
            "mlra_jax.info",
            "mlra_jax.generate",
            "mlra_jax.eval",
            "mlra_jax.benchmarks",
            "mlra_jax.convert",
            "mlra_jax.plot",
        ),
    ),
)
SELF_CONTAINED = ("kernels",)  # layers that import nothing of the other layers
# Top-level names the installed code must never import: the tests, and the folders' generic names.
FORBIDDEN_ROOTS = ("tests", "conftest", "helpers", "experiments", "pallas_kernels")


def source_roots() -> dict[str, Path]:
    """Import name -> folder of every installed package, from pyproject.toml."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    return {name: ROOT / mapped.get(name, name.replace(".", "/")) for name in setuptools["packages"]}


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in source_roots().items():
        for path in folder.glob("*.py"):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def imports_of(module: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(known modules that `module` imports, top-level names of every import) anywhere in its file."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    targets, roots = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            roots.add(name.split(".")[0])
            while name and name not in known:  # `import a.b.c` of a package: the deepest known module
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
    return targets - {module}, roots


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = module_files()
    graph, roots = {}, {}
    for module, path in files.items():
        graph[module], roots[module] = imports_of(module, path, set(files))
    return graph, roots


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def room(module: str) -> str:
    """The package (or top-level module) a module lives in: mlra_jax.decode.generator -> mlra_jax.decode."""
    return ".".join(module.split(".")[:2])


def rooms_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return rooms


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs > mine or (LAYERS[mine][0] in SELF_CONTAINED and theirs != mine):
                found.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    return found


# The command-line modules, and the modules that may import them: the commands (python -m ...).
CLI_MODULES = ("mlra_jax.cli", "mlra_jax.command")
COMMANDS = (*LAYERS[-1][1], "mlra_jax.__main__", "mlra_jax.data.prepare")
# What trains (the model, its layers and attention, the step and the loop): none of it knows the serving layer.
TRAINING = (
    "mlra_jax.training",
    "mlra_jax.train",
    "mlra_jax.loss",
    "mlra_jax.model",
    "mlra_jax.layers",
    "mlra_jax.attention",
    "mlra_jax.optim",
    "mlra_jax.params",
    "mlra_jax.fp8",
)


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def cli_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules that import a command-line module without being a command themselves."""
    found = {m: sorted(t for t in targets if t in CLI_MODULES) for m, targets in graph.items()}
    return {m: t for m, t in found.items() if t and m not in CLI_MODULES and not within(m, COMMANDS)}


def decode_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Training modules that import the decoding and serving layer (mlra_jax.decode)."""
    found = {m: sorted(t for t in targets if within(t, ("mlra_jax.decode",))) for m, targets in graph.items()}
    return {m: t for m, t in found.items() if t and within(m, TRAINING)}


def test_no_library_module_imports_a_command_line_module():
    """Config reading lives in run_config, did_you_mean in config: only the commands import cli and command."""
    assert cli_imports(import_graph()[0]) == {}


def test_training_modules_do_not_import_the_serving_layer():
    assert decode_imports(import_graph()[0]) == {}


def test_every_installed_module_is_seen():
    files = module_files()
    assert {
        "mlra_jax.variants",
        "mlra_jax.config",
        "mlra_jax.experiments.paper",
        "mlra_jax.kv_cache",
        "mlra_jax.pallas_kernels.latent_decode_gpu",
        "mlra_jax.attention.latent",
    } <= set(files)
    on_disk = {p for folder in ("mlra_jax", "experiments", "pallas_kernels") for p in (ROOT / folder).rglob("*.py")}
    assert on_disk == set(files.values()), "a package folder is missing from pyproject's packages"


def test_no_circles_between_modules():
    assert find_cycles(import_graph()[0]) == []


def test_no_circles_between_rooms():
    """Packages count as one node: model -> decode.cache with decode.generator -> model is a circle."""
    assert find_cycles(rooms_graph(import_graph()[0])) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    assert layer_violations(import_graph()[0]) == []


def test_no_import_of_tests_or_of_the_folders_generic_names():
    graph, roots = import_graph()
    assert {m: sorted(r & set(FORBIDDEN_ROOTS)) for m, r in roots.items() if r & set(FORBIDDEN_ROOTS)} == {}


def test_hf_remote_code_stands_alone():
    """configuration_mlra.py and modeling_mlra.py run inside exported Hugging Face folders (trust_remote_code): they
    import nothing of mlra_jax, and the library never imports them (they need torch and transformers)."""
    graph = import_graph()[0]
    config, modeling = "mlra_jax.hf_remote_code.configuration_mlra", "mlra_jax.hf_remote_code.modeling_mlra"
    assert {m: graph[m] for m in graph if m.startswith("mlra_jax.hf_remote_code.")} == {
        config: set(),
        modeling: {config},
    }
    assert sorted(m for m, targets in graph.items() if targets & {config, modeling} and m != modeling) == []


def test_the_checks_catch_what_they_should():
    assert cli_imports({"mlra_jax.training.init_from": {"mlra_jax.cli"}, "mlra_jax.eval": {"mlra_jax.cli"}}) == {
        "mlra_jax.training.init_from": ["mlra_jax.cli"]
    }
    assert decode_imports(
        {"mlra_jax.attention.latent": {"mlra_jax.decode.serving"}, "mlra_jax.generate": {"mlra_jax.decode.generator"}}
    ) == {"mlra_jax.attention.latent": ["mlra_jax.decode.serving"]}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert rooms_graph(
        {
            "mlra_jax.model": {"mlra_jax.decode.cache"},
            "mlra_jax.decode.generator": {"mlra_jax.model"},
            "mlra_jax.decode.cache": set(),
        }
    ) == {"mlra_jax.model": {"mlra_jax.decode"}, "mlra_jax.decode": {"mlra_jax.model"}}
    assert layer_violations(
        {
            "mlra_jax.config": {"mlra_jax.attention"},
            "mlra_jax.pallas_kernels.x": {"mlra_jax.config"},
            "mlra_jax.model": {"mlra_jax.benchmarks.common", "mlra_jax.config"},
            "mlra_jax.info": {"mlra_jax.experiments"},
        }
    ) == [
        "mlra_jax.config (config) imports mlra_jax.attention (library)",
        "mlra_jax.model (library) imports mlra_jax.benchmarks.common (entry points)",
        "mlra_jax.pallas_kernels.x (kernels) imports mlra_jax.config (config)",
    ]


# The serving layouts' names (decode.layouts); the modules that train know none of them.
SERVING_LAYOUT_NAMES = re.compile(r"\b(out_major|kv_up_layout|gate_up|x_proj|use_serving_layout|serving_layout)\b")


def serving_layout_mentions(paths: list[Path]) -> dict[str, list[str]]:
    found = {str(p.relative_to(ROOT)): sorted(set(SERVING_LAYOUT_NAMES.findall(p.read_text()))) for p in paths}
    return {name: names for name, names in found.items() if names}


def test_the_attention_modules_and_layers_name_no_serving_layout():
    paths = [*sorted((ROOT / "mlra_jax" / "attention").glob("*.py")), ROOT / "mlra_jax" / "layers.py"]
    assert len(paths) > 5 and serving_layout_mentions(paths) == {}
    assert serving_layout_mentions([ROOT / "mlra_jax" / "decode" / "layouts.py"]) != {}  # the check sees them
