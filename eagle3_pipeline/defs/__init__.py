"""The Dagster layer: assets, resources and the Definitions factory. Thin over the domain."""
