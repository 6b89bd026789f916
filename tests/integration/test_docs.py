"""docs/configuration.md documents every flag and environment variable.

* every `--flag` token printed by every command's and subcommand's `--help`
  appears in docs/configuration.md (so a new flag without documentation
  fails here);
* the generated section of docs/configuration.md equals what
  tools/gen_config_doc.py produces from the binary now (regenerate it with
  `python3 tools/gen_config_doc.py`);
* every environment variable the C code reads (getenv("X") or the connector's
  env_value("X") wrapper in src/ and bench/) appears in docs/configuration.md;
* every kv_transfer_config key of src/connector/kv_transfer_config.c's key
  tables appears in docs/configuration.md;
* the docs the README links to exist.
"""
import importlib.util
import re

from conftest import REPO_ROOT

DOC = REPO_ROOT / "docs" / "configuration.md"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_doc",
                                                  REPO_ROOT / "tools" / "gen_config_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def doc_text():
    return DOC.read_text()


def test_every_help_flag_is_documented(disagg_bin):
    gen = load_generator()
    doc = doc_text()
    documented = gen.flags_in(doc)
    missing = {}
    seen = 0
    for cmd in gen.COMMANDS:
        flags = gen.flags_in(gen.help_text(disagg_bin, cmd))
        seen += len(flags)
        lost = sorted(flags - documented)
        if lost:
            missing["disagg " + " ".join(cmd)] = lost
    assert seen > 100, f"only {seen} flags found in the --help texts: is the parser broken?"
    assert not missing, f"flags printed by --help but absent from {DOC}: {missing}"


def test_every_command_has_a_section(disagg_bin):
    """The generator's command list covers every command `disagg --help` lists."""
    import subprocess
    gen = load_generator()
    out = subprocess.run([disagg_bin, "--help"], capture_output=True, text=True, timeout=30).stdout
    names = re.findall(r"^  (\w+)\s", out, flags=re.M)
    assert len(names) >= 7, out
    covered = {c[0] for c in gen.COMMANDS}
    assert set(names) <= covered, f"commands without a section: {set(names) - covered}"
    doc = doc_text()
    for cmd in gen.COMMANDS:
        assert f"### `disagg {' '.join(cmd)}`" in doc


def test_generated_section_is_current(disagg_bin):
    gen = load_generator()
    doc = doc_text()
    assert gen.splice(doc, gen.generate(disagg_bin)) == doc, (
        "docs/configuration.md's generated flag tables are stale: run "
        "python3 tools/gen_config_doc.py")


ENV_CALL = re.compile(r"\b(?:secure_getenv|getenv|env_value)\s*\(\s*\"([A-Za-z_][A-Za-z0-9_]*)\"")


def env_names_in_code():
    names = set()
    for top in ("src", "bench"):
        for path in (REPO_ROOT / top).rglob("*.[ch]"):
            names |= set(ENV_CALL.findall(path.read_text(errors="replace")))
    return names


def test_every_env_var_is_documented():
    names = env_names_in_code()
    # the ones the brief names must be among those the code reads
    for must in ("VLLM_MOONCAKE_BOOTSTRAP_PORT", "VLLM_MOONCAKE_CONNECTOR_TIMEOUT",
                 "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "VLLM_HOST_IP", "WITH_NVIDIA_PEERMEM",
                 "DISAGG_LOG_LEVEL", "DISAGG_CPU_ISA", "OPENAI_API_KEY"):
        assert must in names, f"{must} is no longer read by the code: update this test and the doc"
    doc = doc_text()
    missing = sorted(n for n in names if not re.search(r"`\$?" + re.escape(n) + r"`", doc))
    assert not missing, f"environment variables read in src/ or bench/ but not in {DOC}: {missing}"


def kv_config_keys():
    src = (REPO_ROOT / "src" / "connector" / "kv_transfer_config.c").read_text()
    top = re.search(r"TOP_KEYS\[\] = \{(.*?)\};", src, re.S).group(1)
    extra = re.search(r"EXTRA_KEYS\[\] = \{(.*?)\};", src, re.S).group(1)
    return re.findall(r"\{\"(\w+)\"", top), re.findall(r"\"(\w+)\"", extra)


def test_every_kv_transfer_config_key_is_documented():
    top, extra = kv_config_keys()
    assert len(top) >= 13 and len(extra) >= 4, (top, extra)
    doc = doc_text()
    missing = [k for k in top + extra if f"`{k}`" not in doc]
    assert not missing, f"kv_transfer_config keys absent from {DOC}: {missing}"


def test_readme_links_exist():
    readme = (REPO_ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme)
    assert "docs/configuration.md" in links and "docs/architecture.md" in links, links
    for link in links:
        assert (REPO_ROOT / link).is_file(), f"README links to {link}, which does not exist"
