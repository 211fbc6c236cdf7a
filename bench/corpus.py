"""The English text the CPU benchmarks cut their prompts from (one source for all)."""

TEXT = (
    "The printing press, invented around 1440, changed how knowledge spread across Europe. "
    "Books that once took months to copy by hand could be produced in days, and prices fell. "
    "Literacy rose, universities grew, and new ideas in science and religion travelled faster "
    "than any authority could contain them. Historians still argue about how much of the "
    "Renaissance and the Reformation the press made possible, but few doubt its reach. "
)
