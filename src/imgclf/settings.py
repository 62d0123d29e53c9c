"""The config: loaded (by Snakemake, or by the CLI from the same files), validated against the
schema that holds every default, checked beyond what a schema can say, and each hardware entry
resolved on this machine. The slice of it each rule receives is imgclf.slices."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

from imgclf import hardware, layout, weights
from imgclf.errors import UserError

DEMO_ROOT = layout.DEMO_ROOT


def describe_validation_error(err) -> str:
    """One sentence from a jsonschema ValidationError: which key, what is wrong with it."""
    import jsonschema

    if not isinstance(err, jsonschema.ValidationError):
        return f"Config error: {err}."
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        if not allowed:  # free-form maps such as `clusters` nest a schema instead
            return f"Config error in `{where}`: {err.message}."
        place = f"in `{where}`" if where else "at the top level"
        return (f"Config error: unknown key {', '.join(repr(e) for e in extra)} {place} "
                f"({did_you_mean(extra, allowed)}allowed: {', '.join(allowed)}).")
    if err.validator in ("minimum", "exclusiveMinimum"):
        return f"Config error: `{where}` is {err.instance!r} but must be positive ({err.message})."
    if err.validator in ("anyOf", "oneOf"):
        forms = " or ".join(_describe_form(s) for s in err.schema[err.validator])
        return f"Config error: `{where}` = {err.instance!r} is not valid here (expected {forms})."
    return f"Config error: `{where}` = {err.instance!r}: {err.message}."


def did_you_mean(unknown: list[str], allowed: list[str]) -> str:
    """'did you mean 'epochs'? ' for each unknown key that an allowed key is close to (the
    closest): a typo is then found in the sentence, not by reading the list of allowed keys."""
    import difflib

    guesses = [close[0] for key in unknown if (close := difflib.get_close_matches(key, allowed, 1))]
    return f"did you mean {' and '.join(map(repr, guesses))}? " if guesses else ""


def _describe_form(sub: dict) -> str:
    """One alternative of an `anyOf`, in words: 'null', 'auto', 'an integer >= 1', ..."""
    if "$ref" in sub:
        sub = schema()["$defs"][sub["$ref"].rsplit("/", 1)[-1]]
    if "enum" in sub:
        return " or ".join(repr(v) for v in sub["enum"])
    kind = {"null": "null", "integer": "an integer", "number": "a number",
            "array": "a list", "string": "a string"}.get(sub.get("type"), "a value")
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<=")):
        if key in sub:
            kind += f" {sign} {sub[key]}"
    return kind


def checked(config: dict) -> dict:
    """Checks beyond the schema; raise UserError with one sentence naming the key."""
    name = config["cluster"]
    if name not in config["clusters"]:
        raise UserError(f"Unknown cluster {name!r} (config key `cluster`): choose one of "
                        f"{', '.join(sorted(config['clusters']))} or add an entry under `clusters:`.")
    root = data_root(config, name)
    if not is_demo_root(config, root) and not Path(root).is_dir():
        key = f"clusters.{name}.data_root" if config["clusters"][name].get("data_root") \
            else "dataset.root"
        raise UserError(f"Data root {root} does not exist: set `{key}` to the folder that "
                        f"holds train/ and val/.")
    # the weights to start from: there, and not the export the training of `cluster` writes
    weights.check(config["model"].get("init_from"), name)
    return config


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    import yaml

    with open(SCHEMA) as f:
        return yaml.safe_load(f)


def _filling_validator():
    """A JSON-schema validator that also fills in every `default` of the schema, as Snakemake's
    `validate(..., set_default=True)` does: the schema is where the defaults live."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema_):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(key, copy.deepcopy(sub["default"]))
        yield from check_properties(validator, properties, instance, schema_)

    return validators.extend(Draft202012Validator, {"properties": properties_with_defaults})


def validate(instance: dict, part: str | None = None) -> dict:
    """Check `instance` against the config schema (or its top-level section `part`) and fill in
    the defaults, in place; a violation is a UserError naming the key."""
    import jsonschema

    full = schema()
    sub = full if part is None else {"$defs": full["$defs"], **full["properties"][part]}
    errors = sorted(_filling_validator()(sub).iter_errors(instance),
                    key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        if part is not None:
            err = jsonschema.ValidationError(err.message, validator=err.validator,
                                             path=[part, *err.absolute_path], instance=err.instance,
                                             schema=err.schema)
        raise UserError(describe_validation_error(err))
    return instance


def section(params: dict, name: str) -> dict:
    """The config section `name` of a params JSON (what a rule passes the CLI), checked against
    the same schema as the workflow's config and completed with the same defaults, so that
    `imgclf <stage>` and the rule can never disagree."""
    return validate(copy.deepcopy(params.get(name) or {}), name)


def data_root(config: dict, cluster_name: str) -> str:
    entry = config["clusters"].get(cluster_name, {})
    return entry.get("data_root") or config["dataset"]["root"]


def is_demo_root(config: dict, root: str) -> bool:
    return os.path.normpath(root) == os.path.normpath(DEMO_ROOT)


@functools.lru_cache(maxsize=None)
def _cluster(name: str, clusters_items: tuple) -> dict:
    return hardware.resolve_cluster(name, {k: dict(v) for k, v in clusters_items})


def cluster(config: dict, name: str) -> dict:
    """Resolved hardware entry (cached: detection runs nvidia-smi once per process)."""
    items = tuple((k, tuple(sorted(v.items()))) for k, v in config["clusters"].items())
    return _cluster(name, items)


# --- loading outside Snakemake (the CLI) ---------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
DEFAULT_CONFIG = REPO / "config" / "config.yaml"


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(configfiles=(), overrides: dict | None = None) -> dict:
    """config/config.yaml, then each file in `configfiles`, then `overrides`, validated (and
    completed with the schema's defaults) as the workflow validates it."""
    import yaml

    config: dict = {}
    for path in [DEFAULT_CONFIG, *configfiles]:
        try:
            with open(path) as f:
                config = _merge(config, yaml.safe_load(f) or {})
        except FileNotFoundError:
            raise UserError(f"Config file {path} does not exist.") from None
    config = _merge(config, overrides or {})
    return checked(validate(config))


