"""Check a run configuration before you start it: the same string ``flwr run --run-config`` takes.

    fcl-config "strategy='fedran' rank=64 rf-dim=1000"          # ok: prints the run folder
    fcl-config "strategy='fedran' rnk=64"                         # error: unknown config key 'rnk' (did you mean 'rank'?)
    fcl-config --data "dataset='digits' num-tasks=5"              # also loads and splits the data

``flwr run`` answers a key that is not in ``[tool.flwr.app.config]`` only with "Invalid run
configuration." (the SuperLink log names it); this names it, and checks every value the way the
ServerApp will: exit 0 when the configuration can run, 2 (one ``error:`` line) when it cannot.
"""

from __future__ import annotations

import argparse
import sys

from fcl_flower.config import ConfigError, RunConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_config", nargs="*", help="key=value pairs, or a .toml file, as for flwr run --run-config")
    parser.add_argument("--data", action="store_true", help="Also check the run folder and load and split the data.")
    args = parser.parse_args(argv)
    from flwr.common.config import parse_config_args

    from strategies.app import USER_ERRORS

    try:
        try:
            values = parse_config_args(args.run_config)
        except Exception as err:  # ValueError, or click's ClickException (flwr 1.41) for a bad string
            raise ConfigError(f"cannot parse the run config: {err}") from None
        cfg = RunConfig.from_mapping(values)
        if args.data:
            from experiments.sim import check_before_start

            check_before_start(cfg)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    unused = cfg.unused_knobs()
    if unused:
        print(f"note: {cfg.strategy} does not read {', '.join(unused)}", file=sys.stderr)
    print(f"ok: {cfg.strategy} on {cfg.dataset}, results in {cfg.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
