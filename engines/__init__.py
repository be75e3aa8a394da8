"""The serving engines: what each loads and how it runs."""
