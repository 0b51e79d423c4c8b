"""``python -m kvforge ablate [--quick | --full | --config FILE] [--out DIR]
[--resume] [--no-progress]``: the ablation in a Python process, so that an
experiment file can name policies written in Python (``cargo xtask
ablate`` runs such a file this way). Exit status 1 on a bad file or a
failed item, 2 on bad arguments, 0 for --help."""

import sys

USAGE = "usage: python -m kvforge ablate [--quick | --full | --config FILE] [--out DIR] [--resume] [--no-progress]"


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help") or argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.replace("``", ""))
        return 0
    if not argv or argv[0] != "ablate":
        print(USAGE, file=sys.stderr)
        return 2
    config, out, resume, progress, preset = "configs/ablate.toml", None, False, True, None
    it = iter(argv[1:])
    for a in it:
        if a in ("--quick", "--full", "--config"):
            if preset is not None:
                print("kvforge: give one of --quick, --full and --config", file=sys.stderr)
                return 2
            preset = a
            config = f"configs/{a[2:]}.toml" if a != "--config" else next(it, None)
        elif a == "--out":
            out = next(it, None)
            if out is None:
                print("kvforge: --out needs a folder", file=sys.stderr)
                return 2
        elif a == "--resume":
            resume = True
        elif a == "--no-progress":
            progress = False
        else:
            print(f"kvforge: unknown argument {a!r}; {USAGE}", file=sys.stderr)
            return 2
        if config is None:
            print("kvforge: --config needs a file", file=sys.stderr)
            return 2
    from kvforge.ablation import ablate

    try:
        ablate(config, out, resume=resume, progress=progress)
    except (ValueError, RuntimeError) as e:
        print(f"kvforge: {e}", file=sys.stderr)
        last = ablate.last.get("out")
        if last:
            print(f"report: {last}/report.md")
        return 1
    print(f"report: {ablate.last['out']}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
