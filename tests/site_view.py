"""A view of this interpreter's site-packages without some distributions: a site where they were never installed,
for a subprocess started as `python -S -c "import site; site.addsitedir(VIEW) ..."` (the view's .pth files keep
the editable install's mapping of `specdec`)."""

from __future__ import annotations

import os
import site


def site_view(folder, without: tuple[str, ...]):
    """Links in `folder` (a pathlib.Path, made here) to every entry of site-packages except the import packages
    `without` and their `<name>-<version>.dist-info` folders; -> folder."""
    folder.mkdir()
    for sp in site.getsitepackages():
        for name in sorted(os.listdir(sp)):
            if name in without or (name.endswith(".dist-info") and name.split("-")[0] in without):
                continue
            if not (folder / name).exists():
                (folder / name).symlink_to(os.path.join(sp, name))
    return folder
