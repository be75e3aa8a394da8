"""Train an EAGLE-3 draft head: `eagle-train` with method eagle3 (`python scripts/train_eagle3.py --help`).

accelerate launch scripts/train_eagle3.py --config eagle3_smollm2 [key=value ...]
"""

import functools

from eagle_cli.train import main

main = functools.partial(main, method="eagle3")

if __name__ == "__main__":
    main()
