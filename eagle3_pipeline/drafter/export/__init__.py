"""The drafter folders servers load: SpecForge's export layout and vLLM's speculators layout."""
