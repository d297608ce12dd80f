"""Hidden states of the target model: the store format (``store``) and, around it, extraction."""
