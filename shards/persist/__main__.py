"""``python -m clonemap.shards.persist``: verify, dump and back up data directories.

    verify DIR          load every server directory under DIR (or DIR itself) as a
                        server would, read-only on a scratch copy, and print keys,
                        sequence, generation and term; exit 1 on any unreadable file
    dump DIR|FILE       print the map (a directory) or the updates (a segment, such as a
                        dropped-*.cml file) as JSON lines
    backup SRC DEST     copy a live server directory, or every server directory under
                        SRC (e.g. <run-dir>/data), to DEST consistently, then verify it

A backup copies the newest snapshot and the segments after it. Snapshots never change
once written and segments only grow, so a copy taken while the server runs is the map at
some sequence (a record cut by the copy is a torn tail, dropped at load); a compaction
that removes a file during the copy makes the copy start over.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import click

from clonemap.shards.common.errors import Exit
from clonemap.shards.persist import format as fmt
from clonemap.shards.persist.format import CorruptLog
from clonemap.shards.persist.recovery import Recovered, list_files, needed, recover, replay_records

BACKUP_ATTEMPTS = 5


def server_dirs(root: Path) -> list[Path]:
    """``root`` itself if it holds data files, else each subdirectory that does."""
    def holds(path: Path) -> bool:
        files = list_files(path)
        return bool(files.snapshots or files.segments or (path / fmt.TERMS_NAME).exists())
    if holds(root):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and holds(p)) if root.is_dir() else []


def recover_copy(path: Path) -> Recovered:
    """Load a scratch copy of ``path`` (recovery may truncate a torn tail or move an
    incomplete replica aside: never in the original)."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "d"
        shutil.copytree(path, copy)
        return recover(copy)


def verify_dir(path: Path) -> dict:
    got = recover_copy(path)
    return {"dir": str(path), "keys": len(got.store), "seq": got.store.seq,
            "generation": got.generation, "term": got.term,
            "ttl_keys": got.store.ttl_keys, "snapshot_seq": got.snapshot_seq,
            "segment_updates": got.records, "torn_bytes": got.torn_bytes,
            "incomplete": bool(got.incomplete)}


def copy_consistent(src: Path, dest: Path) -> None:
    for _ in range(BACKUP_ATTEMPTS):
        snapshot, segments = needed(list_files(src))
        wanted = ([snapshot[1]] if snapshot else []) + [p for _, p in segments]
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        try:
            terms = src / fmt.TERMS_NAME
            if terms.exists():
                shutil.copy2(terms, dest / fmt.TERMS_NAME)
            for path in wanted:
                shutil.copy2(path, dest / path.name)
            return
        except FileNotFoundError:
            continue  # a compaction removed a file meanwhile: list again
    raise click.ClickException(f"{src}: files kept changing during {BACKUP_ATTEMPTS} "
                               "attempts")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Verify, dump and back up clonemap data directories."""


@main.command()
@click.argument("root", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify(root: Path):
    """Load every server directory under ROOT; print what each holds."""
    dirs = server_dirs(root)
    if not dirs:
        raise click.ClickException(f"{root}: no clonemap data files")
    failed = 0
    for path in dirs:
        try:
            click.echo(json.dumps(verify_dir(path)))
        except (CorruptLog, OSError) as exc:
            failed += 1
            click.echo(f"{path}: {exc}", err=True)
    sys.exit(Exit.FAILED if failed else Exit.OK)


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
def dump(target: Path):
    """Print a directory's map, or a segment file's updates, as JSON lines."""
    def text(raw: bytes) -> str:
        return raw.decode("utf-8", "backslashreplace")
    try:
        if target.is_dir():
            store = recover_copy(target).store
            for key, value in sorted(store.items()):
                click.echo(json.dumps({"key": text(key), "value": text(value),
                                       "expires": store.expiry_of(key)}))
        else:
            for seq, key, value, expires in replay_records(target):
                click.echo(json.dumps({"seq": seq, "key": text(key), "value": text(value),
                                       "expires": expires}))
    except CorruptLog as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
def backup(src: Path, dest: Path):
    """Copy SRC's server directories to DEST consistently, then verify the copy."""
    dirs = server_dirs(src)
    if not dirs:
        raise click.ClickException(f"{src}: no clonemap data files")
    if dest.exists() and any(dest.iterdir()):
        raise click.ClickException(f"{dest} exists and is not empty")
    failed = 0
    for path in dirs:
        target = dest if path == src else dest / path.name
        copy_consistent(path, target)
        try:
            click.echo(json.dumps(verify_dir(target)))
        except CorruptLog as exc:
            failed += 1
            click.echo(f"{target}: {exc}", err=True)
    sys.exit(Exit.FAILED if failed else Exit.OK)


if __name__ == "__main__":
    main()
