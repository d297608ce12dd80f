"""The target model: reading its folder (:mod:`.folder`), the weights the drafter takes from it
(:mod:`.weights`) and the aux layer ids a drafter's config names for SGLang and vLLM (:mod:`.layer_ids`)."""
