"""The endpoints a pipeline sends work to (the pipeline file's `inference` section): the embedded
profile's ``transformers serve`` (:mod:`.embedded`) and the provider that resolves the endpoints of a run,
embedded, configured or the managed server (:mod:`.provider`); the managed servers themselves are
:mod:`eagle3_pipeline.managed`'s."""
