"""Models named by their Hugging Face Hub repository: ``OWNER/REPO[:QUANT]`` or ``OWNER/REPO:FILE.gguf``.

Which file a name picks, as llama-server's ``-hf`` picks it:

- ``OWNER/REPO:QUANT``: the GGUF whose name holds the tag, in any case, between the name's
  separators (``Q4_K_M`` picks ``model-Q4_K_M.gguf``; ``shared/gguf_names.py`` ``tag_matches``);
- ``OWNER/REPO``: the Q4_K_M one where there is one, else the repository's first GGUF;
- ``OWNER/REPO:FILE.gguf``: that file exactly.

Vision projectors (``mmproj`` files) are never picked. A split model (``…-00001-of-00003.gguf``)
is one choice: every part is fetched, and the engine reads the parts as one model. A tag that
matches nothing is refused with the repository's GGUF files and their tags.

Files come through the ``huggingface_hub`` library, imported only when a Hub model is named: its
cache (``HF_HOME``, ``HF_HUB_CACHE``), progress bars, ``HF_TOKEN`` for gated and private
repositories, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``. The repository's listing is read once and
every part fetched at the commit it names. When the Hub cannot be reached (or offline mode is on)
the choice is made among the files the cache holds, and nothing goes over the network.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import ModelLoadError
from shared.gguf_names import quant_tag, split_part, tag_matches

if TYPE_CHECKING:  # huggingface_hub is imported where a Hub model is named, not before
    from huggingface_hub import CachedFileInfo, CachedRepoInfo, CachedRevisionInfo

PREFERRED_TAG = "Q4_K_M"  # what a name without a tag picks, where the repository has it
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[^:/][^:]*))?$")
NAMING = (f"OWNER/REPO[:QUANT] (the GGUF whose name holds the tag; with none, {PREFERRED_TAG} or the first "
          "GGUF) or OWNER/REPO:FILE.gguf")


@dataclass(frozen=True)
class HubName:
    repo: str  # OWNER/REPO
    tag: str | None = None  # a quant tag, or a file's name when it ends in .gguf

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


@dataclass(frozen=True)
class HubModel:
    """A model fetched from the Hub: its files in the repository (one, or every part of a split
    model in order) and their copies in the Hub cache, in the same order."""

    name: HubName
    commit: str
    files: tuple[str, ...]
    paths: tuple[Path, ...]

    @property
    def path(self) -> Path:
        """What the engine opens: the file, or a split model's first part."""
        return self.paths[0]


@dataclass(frozen=True)
class CachedModel:
    repo: str
    files: tuple[str, ...]  # as in HubModel
    size: int  # bytes on disk, every part

    @property
    def tag(self) -> str | None:
        return quant_tag(self.files[0])


def parse_hub_name(argument: str) -> HubName | None:
    """``OWNER/REPO[:QUANT|:FILE.gguf]`` as a HubName; None for what is not one (a path: it
    starts with '/' or '.', has more than one '/', or ends in .gguf before any tag)."""
    match = HUB_NAME.match(argument)
    if match is None or match["repo"].lower().endswith(".gguf"):
        return None
    return HubName(match["repo"], match["tag"])


def gguf_models(files: Iterable[str]) -> list[tuple[str, ...]]:
    """The models among a repository's files, in its order: each GGUF, or the parts of each split
    model together in their order; vision projectors left out."""
    models: dict[str, list[str]] = {}
    for name in files:
        if not name.lower().endswith(".gguf") or "mmproj" in name.lower():
            continue
        split = split_part(name)
        models.setdefault(f"{split[0]} of {split[2]}" if split else name, []).append(name)
    return [tuple(sorted(parts)) for parts in models.values()]


def choose(name: HubName, files: Iterable[str], where: str = "the repository holds") -> tuple[str, ...]:
    """The files ``name`` picks among ``files`` (the repository's, or those in the cache: ``where``
    says which, for the refusal)."""
    models = gguf_models(files)
    if name.tag is None:
        picked = [m for m in models if tag_matches(PREFERRED_TAG, m[0])] or models
    elif name.tag.lower().endswith(".gguf"):
        picked = [m for m in models if name.tag in m]  # a part of a split model picks all of it
    else:
        picked = [m for m in models if tag_matches(name.tag, m[0])]
    if not picked:
        wanted = f"no GGUF file of {name.repo} matches {name.tag!r}" if name.tag else f"{name.repo}: no GGUF file"
        raise ModelLoadError(f"{wanted}; {where}:\n{_describe(models)}" if models else f"{wanted}; {where} none")
    chosen = picked[0]
    split = split_part(chosen[0])
    if split is not None and len(chosen) != split[2]:
        raise ModelLoadError(f"{name}: {where} {len(chosen)} of the {split[2]} parts of {split[0]}: {', '.join(chosen)}")
    return chosen


def _describe(models: list[tuple[str, ...]]) -> str:
    """One line per model: its file (a split model's first part and how many), its quant tag."""
    lines = []
    for files in models:
        parts = f", {len(files)} parts" if len(files) > 1 else ""
        lines.append(f"  {files[0]}  ({quant_tag(files[0]) or 'no quant tag'}{parts})")
    return "\n".join(lines)


def fetch(name: HubName, download: bool = True) -> HubModel:
    """The model ``name`` picks, in the Hub cache: fetched there once (``download`` False: only
    what the cache holds, without the network)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    import httpx2

    commit, files, where = _listing(name.repo, download)
    chosen = choose(name, files, where)
    try:
        paths = [hf_hub_download(name.repo, file, revision=commit, local_files_only=not download)
                 for file in chosen]
    except (HfHubHTTPError, LocalEntryNotFoundError, httpx2.TransportError) as exc:
        raise _explained(name.repo, exc) from exc
    return HubModel(name, commit, chosen, tuple(Path(path) for path in paths))


def cached_models() -> list[CachedModel]:
    """The GGUF models the Hub cache holds, by repository (a file of several cached commits once:
    the latest)."""
    found: dict[tuple[str, tuple[str, ...]], tuple[float, CachedModel]] = {}
    for repo in _cached_repos():
        for revision in repo.revisions:
            sizes = {_relative(file, revision): file.size_on_disk for file in revision.files}
            for files in gguf_models(sorted(sizes)):
                model = CachedModel(repo.repo_id, files, sum(sizes[file] for file in files))
                key = (repo.repo_id, files)
                if key not in found or found[key][0] < revision.last_modified:
                    found[key] = (revision.last_modified, model)
    return sorted((model for _, model in found.values()), key=lambda m: (m.repo.lower(), m.files))


def cache_location() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _listing(repo: str, online: bool) -> tuple[str, list[str], str]:
    """(commit, the files at it, what they are) from the Hub, or from the cache when the Hub cannot
    be reached or fails (5xx), or ``online`` is False."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    import httpx2

    unreachable: Exception | None = None
    if online:
        try:
            info = HfApi().model_info(repo)
            return info.sha, [sibling.rfilename for sibling in info.siblings or ()], "the repository holds"
        except (OfflineModeIsEnabled, httpx2.TransportError) as exc:
            unreachable = exc
        except HfHubHTTPError as exc:
            if exc.response.status_code < 500:
                raise _explained(repo, exc) from exc
            unreachable = exc
    revision = _cached_revision(repo)
    if revision is None:
        reason = f"{constants.ENDPOINT} cannot be reached ({unreachable})" if unreachable \
            else "only the cache is looked in"
        raise ModelLoadError(f"{repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {reason}")
    where = f"the cache holds ({constants.ENDPOINT} cannot be reached)" if unreachable else "the cache holds"
    return revision.commit_hash, [_relative(file, revision) for file in revision.files], where


def _explained(repo: str, exc: Exception) -> ModelLoadError:
    """A refusal or failure of the Hub as a ModelLoadError that says what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    page = f"{constants.ENDPOINT}/{repo}"
    token = "set HF_TOKEN to an access token that may read it"
    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{repo} is a gated model: accept its licence on {page} (logged in), then {token} "
                              f"({constants.ENDPOINT}/settings/tokens)")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(f"{repo}: no such model repository on {constants.ENDPOINT} (nor a file of that path "
                              f"here); if it is private or gated, {token}")
    if isinstance(exc, HfHubHTTPError) and exc.response.status_code in (401, 403):
        return ModelLoadError(f"the Hub refused {repo} ({exc.response.status_code}): {token}; a gated model also "
                              f"needs its licence accepted on {page}")
    if isinstance(exc, HfHubHTTPError):
        return ModelLoadError(f"the Hub answered {exc.response.status_code} for {repo}: {exc}")
    return ModelLoadError(f"{repo} could not be fetched from {constants.ENDPOINT}: {exc}")


def _cached_repos() -> list[CachedRepoInfo]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return [repo for repo in scan_cache_dir().repos if repo.repo_type == "model"]
    except CacheNotFound:
        return []


def _cached_revision(repo: str) -> CachedRevisionInfo | None:
    """The cached commit of ``repo`` a name resolves to offline: the one ``main`` points at,
    else the latest."""
    revisions = [revision for cached in _cached_repos() if cached.repo_id == repo for revision in cached.revisions]
    return max(revisions, key=lambda r: ("main" in r.refs, r.last_modified), default=None)


def _relative(file: CachedFileInfo, revision: CachedRevisionInfo) -> str:
    """A cached file's path in its repository."""
    return file.file_path.relative_to(revision.snapshot_path).as_posix()
