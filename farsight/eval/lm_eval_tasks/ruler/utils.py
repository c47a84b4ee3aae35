"""RULER's string-match score for farsight's RULER-style lm-eval tasks.

Self-contained (no farsight import), so an exported task folder runs wherever lm-eval does; it
scores exactly as `farsight.eval.ruler.string_match`.
"""


def string_match(predicted, references):
    """The fraction of `references` found in `predicted`, ignoring case."""
    text = predicted.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def process_results(doc, results):
    """lm-eval hook: score the one generation of a document against its references."""
    return {"string_match": string_match(results[0], doc["outputs"])}
