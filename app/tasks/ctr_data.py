"""Synthetic click logs shaped like Criteo's, with a planted teacher: data whose ceiling is known.

Every example is a function of its index alone (stateless hashes, no table or
array stored anywhere), so any worker can generate any part of the data set
and pipeline i of n simply takes the indices i, i+n, ...:

- 13 dense features: counts whose logarithm is normal, as Criteo's are;
- 26 categorical features, one per table: a rank drawn from a truncated Zipf
  law over the table's rows, turned into a row id by a permutation that
  spreads the hot ranks over the id space ("spread"), or the rank itself
  ("ranked", the hot rows at the front of the table);
- a click drawn with the teacher's probability: a logistic model with a
  weight and a small factor vector per (feature, id), generated from a hash
  of (seed, feature, id), their pairwise dot products (a factorisation
  machine) and a linear term in the logarithm of the dense features.

The teacher's probabilities give the Bayes-optimal AUC and log-loss of any
evaluation set: the ceiling a model of these features can reach.

The Zipf law is the discretised continuous power law: rank r has probability
F(r + 2) - F(r + 1) with F(x) = (x^(1-s) - 1) / ((C + 1)^(1-s) - 1), which
is exactly what inverse-CDF sampling of a uniform draws, so the expected
number of distinct rows a batch reads (`expected_distinct`) is exact too.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

# Rows per categorical feature in Criteo's display-advertising challenge (Kaggle) data.
CRITEO_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
               3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
               142572)
NUM_DENSE = 13
TEACHER_FACTORS = 3  # one 64-bit hash per (feature, id) gives a weight and 3 factors
# Logit variance of each teacher part, about: the Bayes AUC is then about 0.8
# and the mean click rate about 0.25, both close to Criteo's.
WEIGHT_VARIANCE, FACTOR_VARIANCE, DENSE_VARIANCE, BIAS = 1.0, 1.0, 0.6, -1.85
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def table_rows(scale: float) -> tuple[int, ...]:
    """Criteo's table sizes times `scale`, each at least 2 rows."""
    return tuple(max(2, round(rows * scale)) for rows in CRITEO_ROWS)


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int: the same bits as `_mix`."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def key(*parts: int) -> int:
    """A 64-bit key for a stream of draws, from small non-negative ints."""
    k = 0
    for part in parts:
        k = _mix_int((k + part * _GOLDEN + 1) & _MASK)
    return k


def _mix(x: tf.Tensor) -> tf.Tensor:
    """splitmix64's finaliser, elementwise on uint64 (multiplication wraps)."""
    def step(x, shift, multiplier):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint64)))
        return x * tf.constant(multiplier, tf.uint64) if multiplier else x
    x = step(x, 30, 0xBF58476D1CE4E5B9)
    x = step(x, 27, 0x94D049BB133111EB)
    return step(x, 31, 0)


def hash64(keys: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """64 random-looking bits per (key, value): keys and values broadcast (uint64)."""
    return _mix(values * tf.constant(_GOLDEN, tf.uint64) + keys)


def _uniform(bits: tf.Tensor, width: int, dtype: tf.DType) -> tf.Tensor:
    """A uniform in (0, 1) from the low `width` bits of a uint64 tensor."""
    low = tf.bitwise.bitwise_and(bits, tf.constant((1 << width) - 1, tf.uint64))
    u = (tf.cast(low, dtype) + 0.5) / float(1 << width)
    # float32 holds 24 significant bits (float64 53), so at width 24 (53) the top
    # draw, 2^w - 0.5, rounds up to 2^w and u to exactly 1: erfinv(2u - 1) was inf,
    # an infinite dense count, in one example in 2^24 / 13 (the first is example
    # 4,576,485), whose gradient put NaN into the model's weights for the rest of
    # training. The largest value below 1 keeps the interval open and every other
    # draw as it was.
    return tf.minimum(u, np.nextafter(dtype.as_numpy_dtype(1), dtype.as_numpy_dtype(0)))


@dataclasses.dataclass(frozen=True)
class ZipfLaw:
    """Ranks 0..rows-1 of one table, rank r with probability about (r + 1.5)^-s."""

    rows: int
    exponent: float

    def _power(self, x):
        """x^(1-s), or log x when s = 1: F is linear in it."""
        if abs(1 - self.exponent) < 1e-9:
            return np.log(x) if isinstance(x, np.ndarray) else tf.math.log(x)
        return x ** (1 - self.exponent)

    def _span(self) -> float:
        return float(self._power(np.float64(self.rows + 1)) - self._power(np.float64(1)))

    def probabilities(self, start: int, stop: int) -> np.ndarray:
        """P(rank = r) for r in [start, stop), exactly as `sample` draws them."""
        r = np.arange(start, stop, dtype=np.float64)
        return (self._power(r + 2) - self._power(r + 1)) / self._span()


def sample_ranks(laws: list[ZipfLaw], u: tf.Tensor) -> tf.Tensor:
    """Inverse-CDF draws: column f of the uniforms `u` (float64, [n, len(laws)])
    becomes a rank of laws[f]."""
    exponent = laws[0].exponent
    rows = tf.constant([law.rows for law in laws], tf.float64)
    span = tf.constant([law._span() for law in laws], tf.float64)
    level = u * span  # F^-1(u): the x whose x^(1-s) - 1 (or log x) equals u * span
    if abs(1 - exponent) < 1e-9:
        x = tf.exp(level)
    else:
        x = (1 + level) ** (1 / (1 - exponent))
    return tf.cast(tf.clip_by_value(tf.floor(x) - 1, 0, rows - 1), tf.int64)


@dataclasses.dataclass(frozen=True)
class IdMap:
    """Rank -> row id of each table: the identity ("ranked"), or Fibonacci hashing
    id = (a * rank + b) mod rows with a near rows / golden ratio and coprime to
    rows ("spread"), a permutation that scatters consecutive ranks evenly."""

    rows: tuple[int, ...]
    spread: bool
    seed: int

    def coefficients(self, feature: int) -> tuple[int, int]:
        rows = self.rows[feature]
        if not self.spread:
            return 1, 0
        a = max(1, round(rows * 0.6180339887498949))
        while math.gcd(a, rows) != 1:
            a += 1
        return a, key(self.seed, 7, feature) % rows

    def ids(self, ranks: tf.Tensor) -> tf.Tensor:
        """Row ids of int64 ranks [n, features] (a * rank < 2^63 for rows < 2^31)."""
        a, b = zip(*(self.coefficients(f) for f in range(len(self.rows))), strict=True)
        return tf.math.floormod(ranks * tf.constant(a, tf.int64) + tf.constant(b, tf.int64),
                                tf.constant(self.rows, tf.int64))

    def ids_of(self, feature: int, ranks: np.ndarray) -> np.ndarray:
        """`ids` in numpy, for one table."""
        a, b = self.coefficients(feature)
        return (ranks * a + b) % self.rows[feature]


@dataclasses.dataclass(frozen=True)
class Generator:
    """Examples by index: ({"dense", "cat"}, click, the teacher's click probability)."""

    rows: tuple[int, ...]
    exponent: float = 1.05
    spread: bool = True
    seed: int = 0

    @property
    def laws(self) -> list[ZipfLaw]:
        return [ZipfLaw(rows, self.exponent) for rows in self.rows]

    @property
    def id_map(self) -> IdMap:
        return IdMap(self.rows, self.spread, self.seed)

    def _keys(self, stream: int, count: int) -> tf.Tensor:
        # Through numpy: inside a tf.function, a list of ints >= 2^63 would pass through float64.
        return tf.constant(np.array([key(self.seed, stream, i) for i in range(count)], np.uint64))

    def examples(self, index: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor, tf.Tensor]:
        """The examples numbered `index` (int64, [n]): features, clicks [n, 1] and
        the teacher's click probabilities [n]."""
        i = tf.cast(index, tf.uint64)[:, None]
        ids = self.ids(index)
        normal = tf.math.erfinv(2 * _uniform(hash64(self._keys(2, NUM_DENSE), i), 24,
                                             tf.float32) - 1) * math.sqrt(2)
        dense = tf.floor(tf.exp(normal + 1.0))  # counts, log-normal as Criteo's
        probability = tf.sigmoid(self.logit(dense, ids))
        draw = _uniform(hash64(self._keys(3, 1), i), 24, tf.float32)
        click = tf.cast(draw < probability[:, None], tf.float32)
        return {"dense": dense, "cat": ids}, click, probability

    def ids(self, index: tf.Tensor) -> tf.Tensor:
        """The categorical ids [n, 26] of the examples numbered `index` (int64, [n])."""
        i = tf.cast(index, tf.uint64)[:, None]
        u = _uniform(hash64(self._keys(1, len(self.rows)), i), 53, tf.float64)
        return self.id_map.ids(sample_ranks(self.laws, u))

    def logit(self, dense: tf.Tensor, ids: tf.Tensor, known: tf.Tensor | None = None
              ) -> tf.Tensor:
        """The teacher's logit of features [n, 13] and ids [n, 26]. Where the bool mask
        `known` [n, 26] is False, the id's weight and factors count as their mean, 0:
        the teacher as a model that never learnt those ids can know it."""
        bits = hash64(self._keys(4, len(self.rows)), tf.cast(ids, tf.uint64))
        # Four 16-bit fields of each hash: uniforms of variance 1 (range +-sqrt 3).
        fields = tf.stack([_uniform(tf.bitwise.right_shift(bits, tf.constant(16 * j, tf.uint64)),
                                    16, tf.float32) for j in range(1 + TEACHER_FACTORS)], -1)
        values = (2 * fields - 1) * math.sqrt(3)  # [n, features, 1 + factors]
        if known is not None:
            values *= tf.cast(known, values.dtype)[..., None]
        features = len(self.rows)
        weights = values[..., 0] * math.sqrt(WEIGHT_VARIANCE / features)
        pairs = features * (features - 1) / 2
        factors = values[..., 1:] * (FACTOR_VARIANCE / (pairs * TEACHER_FACTORS)) ** 0.25
        total = tf.reduce_sum(factors, axis=1)
        # sum over pairs f < g of <v_f, v_g>, in O(features): (|sum v|^2 - sum |v|^2) / 2
        interactions = (tf.reduce_sum(total * total, -1)
                        - tf.reduce_sum(factors * factors, [1, 2])) / 2
        return BIAS + tf.reduce_sum(weights, 1) + interactions + self._dense_term(dense)

    def _dense_term(self, dense: tf.Tensor) -> tf.Tensor:
        # Coefficients uniform in (-c, c), of mean square c^2 / 3; log1p of a count
        # floor(e^(1 + N(0, 1))) has variance about 0.68.
        c = math.sqrt(3 * DENSE_VARIANCE / (NUM_DENSE * 0.68))
        coefficients = [((key(self.seed, 5, j) >> 11) / 2**53 * 2 - 1) * c
                        for j in range(NUM_DENSE)]
        return tf.reduce_sum((tf.math.log1p(dense) - 1.3) * tf.constant(coefficients), 1)


def expected_distinct(law: ZipfLaw, id_of, bounds: list[int], batch: int,
                      chunk: int = 1 << 20) -> list[float]:
    """E[distinct rows a batch of `batch` draws reads] in each shard of the table,
    shard s holding rows [bounds[s], bounds[s + 1]): the sum over ranks r of
    1 - (1 - p_r)^batch, each counted in the shard that holds its row id
    (`id_of(ranks)` -> ids). Exact; in chunks of ranks, so that the memory it takes
    (about 50 MiB) does not grow with the table."""
    totals = np.zeros(len(bounds) - 1)
    edges = np.asarray(bounds[1:-1])
    for start in range(0, law.rows, chunk):
        stop = min(law.rows, start + chunk)
        seen = -np.expm1(batch * np.log1p(-law.probabilities(start, stop)))
        shard = np.searchsorted(edges, id_of(np.arange(start, stop, dtype=np.int64)),
                                side="right")
        totals += np.bincount(shard, weights=seen, minlength=len(totals))
    return totals.tolist()


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The exact ROC AUC: the probability a random positive outscores a random
    negative, ties counting half (Mann-Whitney, with average ranks)."""
    labels = np.asarray(labels).reshape(-1).astype(bool)
    _, inverse, counts = np.unique(np.asarray(scores).reshape(-1), return_inverse=True,
                                   return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # 1-based, ties averaged
    positives = int(labels.sum())
    negatives = labels.size - positives
    if not positives or not negatives:
        return float("nan")
    return float((ranks[labels].sum() - positives * (positives + 1) / 2)
                 / (positives * negatives))


def log_loss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean binary cross-entropy of the clicks under `probabilities`."""
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.clip(np.asarray(probabilities, np.float64).reshape(-1), 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))
