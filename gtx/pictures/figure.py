"""Figure plumbing shared by every picture: a Figure drawn without pyplot, written to png, svg or
pdf, or to bytes for an HTML page."""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gtx.errors import GtxError

MAX_CELLS = 512  # per side of a drawn adjacency: longer sequences are binned into blocks
FORMATS = ("png", "svg", "pdf")


class GtxFigure(Figure):
    """A Figure that IPython shows inline as the value of a cell, with or without pyplot's inline backend."""

    def _repr_png_(self) -> bytes:
        return png_bytes(self)


def new_figure(width: float, height: float) -> Figure:
    fig = GtxFigure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # draws without pyplot; savefig still switches canvas for svg and pdf
    return fig


def save(fig: Figure, path: str | Path, fmt: str | None = None) -> Path:
    """Write ``fig`` to ``path`` exactly as given and return it. ``fmt``: png, svg or pdf; by default
    the path's suffix (a path without one needs ``fmt``: nothing is appended, so ``-o /dev/full`` or
    ``-o some_folder`` never becomes another file). Missing parent folders are created. GtxError (one
    line) for an unknown format, one that contradicts the path's suffix, a folder, or a path that
    cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise GtxError(f"{path} is a folder; give a file name, e.g. {path / 'figure.png'}")
    if fmt and fmt.lower() not in FORMATS:
        raise GtxError(f"unknown format {fmt!r}; use png, svg or pdf")
    said = path.suffix[1:].lower()
    if fmt and said in FORMATS and said != fmt.lower():  # a PDF named .png opens as nothing
        raise GtxError(f"{path} is named .{said} but --format is {fmt}; name it .{fmt.lower()}, or leave --format out")
    fmt = fmt.lower() if fmt else path.suffix[1:].lower()
    if fmt not in FORMATS:
        raise GtxError(
            f"cannot tell the format of {path}: name it .png, .svg or .pdf, or give the format (--format png, svg or pdf)"
        )
    ready_to_write(path)
    try:
        fig.savefig(path, format=fmt, dpi=100)
    except OSError as e:
        raise GtxError(f"cannot write {path}: {e.strerror or e}; choose another path") from None
    return path


# files a figure or report never replaces: results tables, checkpoints, settings, code
KEPT_SUFFIXES = (".csv", ".pt", ".json", ".toml", ".py", ".safetensors")


def ready_to_write(path: Path) -> None:
    """Create the folders above ``path``; GtxError if one of them is a file or cannot be made, or if
    ``path`` is an existing file that holds data (``KEPT_SUFFIXES``: a typo in ``-o`` must not
    replace a results table with a picture)."""
    if path.suffix.lower() in KEPT_SUFFIXES and path.is_file():
        raise GtxError(f"{path} exists and holds data ({path.suffix} file); it is not replaced: choose another -o path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GtxError(
            f"cannot write {path}: {e.strerror or e} (creating {path.parent}); choose another path"
        ) from None


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
