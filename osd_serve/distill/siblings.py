"""A local-backend replica that starts in a fresh versions slot (versions.claim_slot) begins from the draft
its sibling slots learned, not the configured one.

A scale-up starts a replica in a fresh slot, and so does a rolling redeploy with a surge (Serve's
max_surge_percent > 0: the new replica starts while the old one still holds its slot; with the default 0, the
old one stops first and the new one takes its slot over). Before this, such a replica served the configured draft (version 0) and
had to learn again from its own traffic what its siblings' versions already held, and the old slots'
versions waited unused for the next redeploy. Only a sibling of the same pair (its slot's replay
``.pair.json``: target and draft names and the target's weights) and of the same draft (the expert's
manifest fingerprint, versions.draft_fingerprint) counts: a version distilled for another target or draft
is no better a start than version 0. Of those, the one whose current version was published last.
Reading another live replica's store is safe: a version's files are written once and renamed into place,
and its current version is never pruned; a version pruned between the manifest read and the load
(a rollback, then an update) is skipped, and the replica starts from version 0 as before.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from safetensors import SafetensorError

from .spill import RecordSpill
from .versions import VersionStore, read_manifest

logger = logging.getLogger("ray.serve")


def learned_at(store: VersionStore) -> float | None:
    """When the store's current version was published, or made current by a rollback since (a version an
    operator went back to stays, unless a sibling learned one after that); None for version 0 (the configured
    draft, which any learned version beats) when no rollback chose it, no version, or a meta file that cannot
    be read."""
    try:
        published = float(store.meta(store.current)["time"]) if store.current else None
    except (OSError, ValueError, KeyError, TypeError):
        published = None
    chosen = store.manifest.get("current_at")
    return max(published or 0.0, chosen) if isinstance(chosen, (int, float)) else published


def newest_sibling(slot: Path, expert: str, draft: str, newer_than: float | None,
                   pair: list[str]) -> tuple[dict | None, dict] | None:
    """(state, meta) of the expert's version to start from: the sibling slots' current version chosen last (its
    learned_at), if later than ``newer_than`` (this replica's own); state None: version 0, the configured draft,
    which a sibling's rollback chose. None: no sibling's is later. slot: this replica's (its parent holds the
    siblings); draft: the expert's draft fingerprint; pair: this replica's (ReplicaSpill.pair), which a learned
    version's meta names (a slot's versions outlive a change of its target). The meta keeps when the version was
    chosen: a sibling that restarts later finds the same weights no newer than its own, and keeps its own."""
    found = []
    for other in sorted(slot.parent.glob("slot-*")):
        if other == slot:
            continue
        try:
            if not (manifest := read_manifest(other / expert)) or manifest.get("draft") != draft:
                continue
            store = VersionStore(other / expert)
            t, version = learned_at(store), store.current
            # version 0 is the same draft on every target; a learned one, only for the pair it learned from
            mine = RecordSpill(other / ".replay").pair() if version == 0 else store.meta(version).get("pair")
            if t is not None and (newer_than is None or t > newer_than) and mine == list(pair):
                found.append((t, other, store, version))
        except (OSError, ValueError, KeyError, TypeError):  # a sibling mid-write, or a foreign file: not a start
            continue
    for t, other, store, version in sorted(found, key=lambda f: f[0], reverse=True):
        try:
            state = store.load(version) if version else None
        except (OSError, KeyError, ValueError, SafetensorError) as e:  # pruned since the manifest was read: the next newest
            logger.warning("versions: %s version %s of %s could not be read (%r)", other.name, version, expert, e)
            continue
        logger.warning("versions: %s of %s starts from %s's version %s, chosen later than its own", expert,
                       slot.name, other.name, version)
        return state, {"reason": "inherited", "from": f"{other.name} version {version}", "pair": list(pair), "time": t,
                       "inherited_at": time.time()}
    return None
