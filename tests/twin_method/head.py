"""The fifth method's head: EAGLE-3's, as its own class (the loader builds the class the method's row names)."""

from eagle_train.methods.eagle3.head import Eagle3Head


class TwinHead(Eagle3Head):
    pass
