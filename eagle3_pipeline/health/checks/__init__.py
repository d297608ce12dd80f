"""One module per health check, named as the check is (`CHECK_NAMES`): what it collects on the
host or asks the server, and the rule that turns that into OK / WARN / CRITICAL / UNKNOWN."""
