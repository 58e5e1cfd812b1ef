"""Copying prompts: a passage given in the prompt and an instruction whose answer repeats or edits it (the work
prompt lookup speculates on: the output copies the prompt). The model's own greedy continuation is measured, never a
forced one. Passages and instructions cycle: prompt i is passage i with instruction i."""
from pipeline.workloads.prompts import chat_ids

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork that turned the "
    "great lens, trimmed the wick, and wrote the weather in a leather book. Ships he never met passed safely in the "
    "dark, and in the morning he slept while gulls argued on the rocks below.",
    "To make bread, mix flour, water, salt and yeast until the dough is smooth. Let it rise in a warm place for two "
    "hours, then shape it into a loaf and let it rise again. Bake it in a hot oven for forty minutes, until the crust "
    "is brown and the loaf sounds hollow when you tap it.",
    "Our meeting on Thursday is moved to Friday at ten in the small conference room. Please bring the budget figures "
    "for the third quarter and a list of the open hiring requests. If you cannot attend, send your notes to Maria "
    "before noon so that she can present them.",
    "The river rises in the mountains, where snow melts into a hundred small streams. It runs through pine forests "
    "and narrow gorges, then slows across a wide plain of farms and villages. Near the coast it splits into many "
    "channels and meets the sea among marshes full of birds.",
    "A hash table stores values under keys. It computes a number from each key, called its hash, and uses that "
    "number to pick a bucket. Looking up a key means hashing it again and searching only that bucket, so the time "
    "stays short even when the table holds millions of entries.",
    "Dear neighbours, the garden club will meet on Saturday morning to plant tulips along the main street. We will "
    "provide bulbs, gloves and coffee. Please bring a trowel if you have one, and wear old clothes. We hope to finish "
    "by lunchtime and celebrate with a picnic in the park.",
    "The train left the station ten minutes late. Outside the window, fields of wheat gave way to orchards, and then "
    "to a long grey lake under low clouds. A child across the aisle counted the cows aloud, and the conductor smiled "
    "as he punched each ticket twice.",
    "Photosynthesis takes place in the leaves of green plants. Chlorophyll absorbs sunlight, and the plant uses that "
    "energy to turn carbon dioxide and water into sugar. Oxygen is released as a by-product, which is why forests "
    "and oceans full of algae are so important for the air we breathe.",
]
INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:",
    "Copy this text exactly as it is written:",
    "Rewrite the following passage in the past tense, changing nothing else:",
    "Repeat the passage below, then stop:",
]


def copy_prompts(n: int, tokenizer) -> list[list[int]]:
    """n chat prompts, each an instruction and a passage that its answer repeats or edits."""
    return [chat_ids(tokenizer, f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{PASSAGES[i % len(PASSAGES)]}")
            for i in range(n)]
