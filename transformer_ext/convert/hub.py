"""Hugging Face hub ids as converter input: ``convert transformers --model Helsinki-NLP/opus-mt-en-de``.

An argument that is not a local path and reads as a hub repository id (``NAME`` or
``ORG/NAME``) is resolved by ``huggingface_hub.snapshot_download`` (the optional ``[hub]``
extra) into a snapshot folder of the hub cache, which the converter then reads like any local
folder. Only the files the converter reads are fetched: the JSON files (configuration,
generation configuration, tokenizer files, shard indexes), the SentencePiece models and the
weights, safetensors first, ``pytorch_model*.bin`` only where a repository has no safetensors.

The cache and the network follow huggingface_hub's own settings: ``HF_HUB_CACHE`` (or
``HF_HOME``) for the cache folder, ``HF_HUB_OFFLINE=1`` to read the cache alone, ``HF_ENDPOINT``,
``HF_TOKEN``. The commit the revision resolved to is returned, for ``provenance.json``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .hf import ConversionError

logger = logging.getLogger(__name__)

__all__ = ["HubSnapshot", "HubError", "looks_like_hub_id", "resolve"]

# Files of a repository the converter reads (hf.py); the weights are fetched separately.
METADATA_PATTERNS = ["*.json", "*.spm", "*.model"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
PICKLE_PATTERNS = ["pytorch_model*.bin"]
# The hub's repository names: letters, digits, '-', '_', '.', at most 96 characters, optionally
# under one owner; no '--' or '..', not starting or ending with '-' or '.'.
_NAME = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?:{_NAME}/)?{_NAME}$")
_TRUE = {"1", "on", "yes", "true"}


class HubError(ConversionError):
    """A hub id that cannot be resolved (not cached while offline, hub unreachable, unknown id,
    huggingface_hub not installed)."""


@dataclass(frozen=True)
class HubSnapshot:
    """A hub repository resolved into a folder of the local cache."""

    repo_id: str
    revision: str  # the commit the requested revision resolved to
    requested_revision: str
    folder: Path

    def provenance(self) -> dict:
        """The ``hub`` entry of ``provenance.json``."""
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "requested_revision": self.requested_revision,
        }


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` can be a hub repository id (``NAME`` or ``ORG/NAME``)."""
    return bool(_HUB_ID.match(text)) and "--" not in text and ".." not in text


def _offline_from_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve(
    source: str | os.PathLike,
    *,
    revision: Optional[str] = None,
    cache_dir: Optional[os.PathLike | str] = None,
    offline: Optional[bool] = None,
) -> Optional[HubSnapshot]:
    """The hub snapshot ``source`` names, or None where ``source`` is a local path (it exists,
    or does not read as a hub id: the converter then reports the missing folder).

    ``cache_dir`` None is huggingface_hub's cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub);
    ``offline`` None reads ``HF_HUB_OFFLINE``. Raises :class:`HubError` (one line naming the id
    and ``HF_HUB_OFFLINE``) where the snapshot cannot be had, and where huggingface_hub is not
    installed.
    """
    source = os.fspath(source)
    if os.path.lexists(source) or not looks_like_hub_id(source):
        return None
    try:
        import huggingface_hub
        from huggingface_hub import constants as hub_constants
        from huggingface_hub import errors as hub_errors
    except ImportError as exc:
        raise HubError(
            f"{source!r} is not a local folder; reading it as a Hugging Face hub id needs the "
            f"huggingface_hub package ({exc}): pip install 'transformer_ext[hub]'"
        ) from None
    if offline is None:
        offline = _offline_from_env() or bool(hub_constants.HF_HUB_OFFLINE)
    requested = revision or "main"
    where = f"the hub cache {cache_dir or hub_constants.HF_HUB_CACHE}"
    mode = "HF_HUB_OFFLINE=1: only the local cache is read" if offline else "HF_HUB_OFFLINE is not set"

    def fetch(patterns: list[str]) -> Path:
        return Path(
            huggingface_hub.snapshot_download(
                source,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=offline,
                allow_patterns=patterns,
            )
        )

    try:
        folder = fetch(METADATA_PATTERNS + SAFETENSORS_PATTERNS)
        if not any(folder.glob("*.safetensors")):
            folder = fetch(METADATA_PATTERNS + PICKLE_PATTERNS)
    except hub_errors.LocalEntryNotFoundError:
        if offline:
            raise HubError(
                f"{source!r} is not a local folder, and hub id {source!r} (revision {requested}) is not "
                f"in {where} ({mode}); download it once without HF_HUB_OFFLINE, or give a local "
                "checkpoint folder"
            ) from None
        raise HubError(
            f"{source!r} is not a local folder, and the hub could not be reached for hub id {source!r} "
            f"(revision {requested}), which is not in {where} either ({mode}); check the network "
            "(HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to read a cached copy"
        ) from None
    except hub_errors.GatedRepoError:
        raise HubError(
            f"hub id {source!r} is a gated repository: accept its conditions on the hub and log in "
            f"(HF_TOKEN) ({mode})"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise HubError(
            f"{source!r} is not a local folder, and the hub has no repository {source!r} (or it is "
            f"private: set HF_TOKEN) ({mode})"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise HubError(f"hub id {source!r} has no revision {requested!r} ({mode})") from None
    except hub_errors.HfHubHTTPError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HubError(
            f"hub id {source!r} (revision {requested}): the hub answered {first} ({mode})"
        ) from None
    snapshot = HubSnapshot(source, folder.name, requested, folder)
    logger.info("hub id %s: revision %s from %s", source, snapshot.revision, folder)
    return snapshot
