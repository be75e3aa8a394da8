"""A fifth method as a user would add one: this folder (its head and its builder) plus one row in
`eagle_train.methods.METHODS` (`tests/test_methods.py` registers it). A chain method: EAGLE-3's head, loss and
layouts under its own name."""
