import os
import textwrap

import pytest

# Installed third-party plugins must not leak into the tests: load no entry points.
os.environ["GTX_LOAD_PLUGINS"] = ""
os.environ.pop("GTX_PLUGINS_DIR", None)

from gtx import plugins  # noqa: E402


@pytest.fixture
def plugin_dir(tmp_path):
    """Write plugin files into a temporary folder: ``plugin_dir(name=source, ...)`` returns the folder,
    not yet loaded; whatever gets loaded from it is unregistered afterwards."""
    folder = tmp_path / "user_plugins"
    folder.mkdir()

    def write(**files):
        for name, source in files.items():
            (folder / f"{name}.py").write_text(textwrap.dedent(source))
        return folder

    yield write
    plugins.unload_dir(folder)
