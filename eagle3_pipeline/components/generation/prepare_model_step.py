"""The `target_model` shell step, run by `PipesSubprocessClient` in its own process so that torch
and transformers never load into the code location or the run worker."""

from __future__ import annotations

from dagster_pipes import open_dagster_pipes

from eagle3_pipeline.target.local_model import prepare_local_model


def main() -> None:
    with open_dagster_pipes() as pipes:
        model_dir, converted = prepare_local_model()
        size = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())
        pipes.log.info(f"{'converted GGUF into' if converted else 'reusing'} {model_dir}")
        pipes.report_asset_materialization(
            metadata={
                "model_dir": {"raw_value": str(model_dir), "type": "path"},
                "converted_now": {"raw_value": converted, "type": "bool"},
                "size_mb": {"raw_value": round(size / 2**20, 1), "type": "float"},
            }
        )


if __name__ == "__main__":
    main()
