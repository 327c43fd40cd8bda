"""One module per CLI sub-command; each defines ``command`` (a ``click.Command``)."""
