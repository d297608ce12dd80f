"""The target model: reading its folder (:mod:`.folder`), the weights the drafter takes from it
(:mod:`.weights`), the aux layer ids a drafter's config names for SGLang and vLLM (:mod:`.layer_ids`) and
the embedded profile's model, prepared once into the model cache (:mod:`.local_model`)."""
