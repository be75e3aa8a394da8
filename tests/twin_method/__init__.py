"""Another method as a user would add one: this folder (its head, its builder and its own key) plus one row in
`eagle_train.methods.METHODS` and a layout of its own in `eagle_train.export.layouts.LAYOUTS` (`tests/test_methods.py`
registers both under the key "twin"). A chain method: EAGLE-3's head and loss under its own name and layout."""
