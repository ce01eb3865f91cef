"""``gtx generate`` and ``gtx export``: a transformers model (``--model hf``) continuing a text under a
pattern, and a fine-tuned hf run written back as a folder transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gtx.attention.module import Attention, check_pattern
from gtx.attention.trainable import check_untrained, stages_of, starts_trained
from gtx.backends import get_backend
from gtx.cli.common import device_option, key_value, results_option
from gtx.errors import GtxError
from gtx.graph.pattern import Pattern
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import MODELS
from gtx.run.config import build_configs, resolve_device


def hf_entry():
    """The hf model plugin's entry (class and config); one line where it is not loaded."""
    if "hf" not in MODELS.names():
        raise GtxError(
            "gtx generate and gtx export need the hf model plugin (plugins/models/hf.py), which is not loaded here"
        )
    return MODELS.get("hf")


@click.command()
@click.argument("run", required=False)
@results_option("Where RUN is looked up.")
@click.option("--prompt", required=True, help="The text to continue.")
@click.option(
    "--set",
    "settings",
    multiple=True,
    callback=key_value,
    metavar="KEY=VALUE",
    help="An hf model setting: path= (a save_pretrained folder, a GGUF file or smollm2) is needed without RUN.",
)
@click.option("--pattern", help="The pattern every query reads its keys by [default: RUN's own, else full].")
@click.option(
    "--decode-pattern",
    help="The pattern each new token reads its keys by (the prompt is read under --pattern) [default: --pattern; "
    "RUN's own where neither is given].",
)
@click.option("--new", type=click.IntRange(min=1), default=32, show_default=True, help="Tokens to generate.")
@click.option(
    "--cache/--no-cache",
    default=True,
    show_default=True,
    help="Keys and values cached (keys no later query reads are dropped), or the whole sequence again per token.",
)
@device_option()
def generate(run, results_dir, prompt, settings, pattern, decode_pattern, new, cache, device):
    """Continue a text greedily with a transformers model (--model hf) under a pattern: a
    save_pretrained folder (--set path=DIR), or RUN, a fine-tuned `gtx run --model hf` (its id, a
    unique prefix or its 6-hex tail; its best checkpoint).

    \b
      gtx generate --set path=DIR --pattern local:w=256 --prompt "Once upon a time" --new 64
      gtx generate 99df6a --prompt "Once upon a time"
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the shell passed that are no UTF-8: click keeps them as surrogates
        raise GtxError(
            f"--prompt is not UTF-8 text (byte {e.object[e.start].encode('utf-8', 'surrogateescape')!r} at position {e.start}); "
            "give the prompt in UTF-8"
        ) from None
    entry = hf_entry()
    if run is not None:
        if settings:
            raise GtxError(f"gtx generate {run} uses the run's own model settings; drop --set")
        model, r = trained_run(run, results_dir, pattern, device)
        config, p, tokenizer = r.model_config, r.pattern, r.task.tokenizer
        if tokenizer is None:
            raise GtxError(
                f"run {run} read task {r.config.task}'s own symbols, not text with a tokenizer: gtx generate continues "
                "text; fine-tune a save_pretrained folder (--set path=DIR) to generate from it"
            )
        d = _decode_pattern(decode_pattern, p if pattern else r.decode, p, config, r.config.backend, r.device)
        entry.obj.check_cacheable(p, cache, d)
    else:
        config = build_configs(settings, {"model": ("hf", entry.config)})["model"]
        if not config.path:
            raise GtxError(
                "gtx generate reads text with the model's own tokenizer: give RUN (a fine-tuned hf run) or --set path=DIR "
                "(a save_pretrained folder, a GGUF file or smollm2)"
            )
        p, where = parse_pattern(pattern or "full"), resolve_device(device)
        backend = get_backend("auto", where)
        check_pattern(p, backend, config.heads)
        d = _decode_pattern(decode_pattern, p, p, config, "auto", where)
        entry.obj.check_cacheable(p, cache, d)
        check_untrained(p, config, "generating")
        tokenizer = entry.obj.tokenizer(config)
    ids = tokenizer.vocab.encode(tokenizer.tokenize(prompt))
    if not ids or len(ids) + new > config.max_len:
        raise GtxError(
            f"--prompt of {len(ids)} tokens and --new {new}: the model has {config.max_len} positions; "
            "give a non-empty prompt and at most that many tokens in all"
        )
    if run is None:
        model = entry.obj(
            config,
            tokenizer.vocab,
            tokenizer.vocab,
            Attention.for_width(backend, p, config.heads, config.dim, starts_trained(config)),
        ).to(where)
    out = model.generate(ids, new, p, cache, decode=d)
    click.echo(prompt + tokenizer.detokenize(tokenizer.vocab.decode(out.tokens)))
    held = (
        f"the cache held at most {out.cached} keys per layer"
        if cache
        else "no cache: every query read the whole sequence"
    )
    stage = stages_of(model)
    source = f" (run {run}'s fine-tuned weights)" if run is not None else ""
    untrained = " (its own parameters untrained)" if run is None and p.trainable is not None else ""
    decoded = f", decoded under {d.spec}" if d.spec != p.spec else ""
    click.echo(
        f"{len(out.tokens)} tokens under {p.spec}{decoded}{source}{untrained}{f' ({stage})' if stage else ''}; {held} "
        f"(of {out.positions} positions)",
        err=True,
    )


def _decode_pattern(given: str | None, default: Pattern, prompt: Pattern, config, backend: str, device) -> Pattern:
    """The pattern new tokens are read under: ``given`` (``--decode-pattern``), else ``default``;
    one line where the model cannot attend with it (parameters of its own that ``prompt``, the
    pattern the model was built for, does not give it)."""
    d = parse_pattern(given) if given else default
    if d.spec != prompt.spec and d.trainable is not None:
        raise GtxError(
            f"--decode-pattern {d.spec} attends with parameters of its own, which the model built for pattern "
            f"{prompt.spec!r} lacks; decode under a pattern without them"
        )
    check_pattern(d, get_backend(backend, device), config.heads)
    return d


@click.command()
@click.argument("run")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@results_option("Where RUN is looked up.")
def export(run, folder, results_dir):
    """Write a fine-tuned `gtx run --model hf` as a save_pretrained FOLDER that transformers loads.

    RUN: its id, a unique prefix or its 6-hex tail (its best checkpoint). FOLDER must be new or
    empty. It holds config.json and the weights, the tokenizer where the run read text with one
    (else gtx_vocab.json: the task's symbols by id), and, where the run's pattern has trained
    parameters of its own (nsa's gates, dsa's indexer), gtx_pattern.safetensors beside them; its
    README.md says what a plain transformers loader runs: under a pattern transformers cannot express
    (a window, a selection), full causal attention, which the export also says in one line.
    """
    from gtx.files import check_writable

    if folder.exists() and any(folder.iterdir()):
        raise GtxError(f"{folder} is not empty; export into a new folder (nothing there is overwritten)")
    check_writable(folder, "export folder")
    model, r = trained_run(run, results_dir, None, "cpu")
    # a link's folder is what is written, the link left in place (the rename would meet the link itself)
    written = export_folder(model, r, folder.resolve() if folder.is_symlink() else folder)
    click.echo(
        f"run {run} ({r.config.task}, {r.chosen.spec}): {', '.join(written)} in {folder}; "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}) loads it",
        err=True,
    )
    if not runs_as_transformers(r.chosen):
        click.echo(f"note: {plain_loader_note(r.chosen.spec, folder)}", err=True)
    click.echo(folder)


def runs_as_transformers(pattern) -> bool:
    """Whether transformers' own attention computes what ``pattern`` does on a causal LM: every earlier
    key, no bias, no choice, no parameters of its own (``full``, ``causal``)."""
    return pattern.plain and pattern.structures.get("dd") == "causal"


def plain_loader_note(spec: str, folder: Path) -> str:
    """What a plain loader of an export trained under ``spec`` runs, and how to run what was trained."""
    return (
        f"trained under {spec}, which transformers cannot express: a plain transformers loader runs full causal "
        f"attention over these weights, which computes something else; gtx runs what was trained: "
        f"--model hf --set path={folder.resolve()} --pattern {spec!r}"
    )


def trained_run(ref: str, results_dir: str, pattern: str | None, device: str):
    """(model, r): the fine-tuned model of an hf run under ``results_dir`` (``gtx.measure.probe.load_model``,
    under ``pattern`` or its own) and its resolved configuration; one line for a run of another model."""
    from gtx.measure.probe import load_model
    from gtx.records import checkpoint
    from gtx.records.runref import find_checkpoint

    path = find_checkpoint(ref, results_dir)
    trained = checkpoint.load(path, mmap=True)["run_config"]
    if trained["model"] != "hf":
        raise GtxError(
            f"run {ref} trained model {trained['model']!r}; gtx generate and gtx export take runs of --model hf"
        )
    model, r, _ = load_model(str(path), results_dir, device, pattern=pattern)
    return model, r


def export_readme(r, folder: Path) -> str:
    """The exported folder's README: where it comes from and what a loader computes with it."""
    spec = r.chosen.spec
    runs = (
        f"Trained under `{spec}`, which is what transformers' own attention computes: "
        "`transformers.AutoModelForCausalLM.from_pretrained(FOLDER)` runs what was trained."
        if runs_as_transformers(r.chosen)
        else f"Note: {plain_loader_note(spec, folder)}."
    )
    own = " `gtx_pattern.safetensors` holds the pattern's own trained parameters." if r.chosen.trainable else ""
    return f"# {folder.name}\n\nA `gtx run --model hf` fine-tuned on task `{r.config.task}`, exported by `gtx export`.\n\n{runs}{own}\n"


def export_folder(model, r, folder: Path) -> list[str]:
    """Write ``model`` (a trained ``HFModel``) to ``folder`` as transformers' ``save_pretrained`` does,
    its tokenizer (or ``gtx_vocab.json``), its pattern's own parameters (``gtx_pattern.safetensors``,
    with the pattern's spec in its metadata) and a README saying what a plain loader runs; built in a sibling folder and renamed, so a failure leaves none."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError as e:  # where os.access said yes but the file system says no (/sys as root)
        raise GtxError(
            f"export folder {folder}: cannot write there ({e.strerror}); choose another export folder"
        ) from None
    try:
        implementation = model.hf.config._attn_implementation
        model.hf.config._attn_implementation = (
            "sdpa"  # "gtx" is registered by gtx alone: the folder loads with transformers' own
        )
        try:
            model.hf.save_pretrained(work)
        finally:
            model.hf.config._attn_implementation = implementation
        if r.task.tokenizer is not None:
            r.task.tokenizer.hf.save_pretrained(work)
        else:
            (work / "gtx_vocab.json").write_text(json.dumps(list(r.task.tgt_vocab.itos)))
        own = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith("hf.")}
        if own:
            save_file(
                own, work / "gtx_pattern.safetensors", metadata={"pattern": r.chosen.spec, "format": "gtx-pattern/1"}
            )
        (work / "README.md").write_text(export_readme(r, folder))
        if folder.exists():
            folder.rmdir()  # empty: checked by the caller
        work.rename(folder)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return sorted(p.name for p in folder.iterdir())
