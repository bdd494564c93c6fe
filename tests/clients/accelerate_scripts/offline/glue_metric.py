"""A local stand-in for the hub's ``glue`` metric of ``evaluate``, MRPC only: accuracy and F1 of binary labels.

``evaluate.load("glue", "mrpc")`` loads ``glue/glue.py`` from the working directory when it exists, so the shipped
scripts that score MRPC run offline with this module copied there.
"""

import datasets
import evaluate


class Glue(evaluate.Metric):
    """Accuracy and F1 (positive class 1) of integer predictions against integer references."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name != "mrpc":
            raise KeyError(f"this offline glue metric implements config 'mrpc' only, not {self.config_name!r}")
        features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
        return evaluate.MetricInfo(description="GLUE MRPC: accuracy and F1", citation="", features=features)

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        pairs = list(zip(predictions, references, strict=True))
        accuracy = sum(p == r for p, r in pairs) / len(pairs)
        true_pos = sum(p == r == 1 for p, r in pairs)
        predicted, actual = sum(p == 1 for p, _ in pairs), sum(r == 1 for _, r in pairs)
        f1 = 2 * true_pos / (predicted + actual) if predicted + actual else 0.0
        return {"accuracy": float(accuracy), "f1": float(f1)}
