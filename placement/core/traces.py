"""Azure Functions trace replay, as AlpaServe §6.2 does it.

Two published formats:

* MAF 2019 (`invocations_per_function_md.anon.dNN.csv`): one row per function,
  ``HashOwner,HashApp,HashFunction,Trigger,1,2,...,1440``, the invocation count of each minute of the day;
* MAF 2021 (`AzureFunctionsInvocationTraceForTwoWeeksJan2021.txt`): one row per invocation,
  ``app,func,end_timestamp,duration`` in seconds from the trace start; the arrival is end_timestamp - duration.

Functions are dealt round robin to models (AlpaServe §6.2, following [4, 25]); each model's traffic is cut into
windows and a Gamma process (rate, CV) is fitted per window; rates and CVs are scaled by factors and a new
workload is resampled with a seed.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from placement.core.arrivals import GammaProcess
from placement.core.workload import Workload

logger = logging.getLogger(__name__)

SECONDS_PER_MINUTE = 60.0
#: CV assumed for a window with too few arrivals to measure one (a Poisson process).
DEFAULT_CV = 1.0
#: Fewest inter-arrival gaps (MAF 2021) or minutes (MAF 2019) from which a window's CV is estimated.
MIN_SAMPLES_FOR_CV = 2
#: Fitted CVs are kept within these bounds (a zero CV cannot be resampled).
MIN_FITTED_CV, MAX_FITTED_CV = 0.05, 50.0
MAF2019_FIXED_COLUMNS = ("HashOwner", "HashApp", "HashFunction", "Trigger")
MAF2021_COLUMNS = ("app", "func", "end_timestamp", "duration")


@dataclass
class Trace:
    """Invocations per function: per-minute counts (MAF 2019) or arrival timestamps (MAF 2021)."""

    format: Literal["maf2019", "maf2021"]
    functions: list[str]
    duration_s: float
    counts_per_minute: np.ndarray | None = None  # [function, minute]
    timestamps_s: list[np.ndarray] | None = None  # per function, sorted


def load_maf2019(path: str | Path) -> Trace:
    """Read a MAF 2019 per-minute invocation-count CSV."""
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(header[:4]) != MAF2019_FIXED_COLUMNS:
            raise ValueError(f"{path}: not a MAF 2019 file (header must start {','.join(MAF2019_FIXED_COLUMNS)})")
        minutes = len(header) - 4
        if minutes < 1 or [int(c) for c in header[4:]] != list(range(1, minutes + 1)):
            raise ValueError(f"{path}: minute columns must be 1..N")
        functions, rows = [], []
        for line, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise ValueError(f"{path}:{line}: {len(row)} fields, expected {len(header)}")
            functions.append(f"{row[0]}/{row[1]}/{row[2]}")
            try:
                counts = [int(float(c)) for c in row[4:]]
            except ValueError as error:
                raise ValueError(f"{path}:{line}: bad count ({error})") from None
            if min(counts) < 0:
                raise ValueError(f"{path}:{line}: negative count")
            rows.append(counts)
    return Trace("maf2019", functions, minutes * SECONDS_PER_MINUTE,
                 counts_per_minute=np.asarray(rows, dtype=np.int64).reshape(len(rows), minutes))


def load_maf2021(path: str | Path) -> Trace:
    """Read a MAF 2021 per-invocation trace; arrival = end_timestamp - duration."""
    per_function: dict[str, list[float]] = {}
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != MAF2021_COLUMNS:
            raise ValueError(f"{path}: not a MAF 2021 file (header must be {','.join(MAF2021_COLUMNS)})")
        for line, row in enumerate(reader, start=2):
            if len(row) != len(MAF2021_COLUMNS):
                raise ValueError(f"{path}:{line}: {len(row)} fields, expected 4")
            try:
                end, duration = float(row[2]), float(row[3])
            except ValueError as error:
                raise ValueError(f"{path}:{line}: bad number ({error})") from None
            per_function.setdefault(f"{row[0]}/{row[1]}", []).append(max(end - duration, 0.0))
    functions = list(per_function)
    stamps = [np.sort(np.asarray(per_function[f])) for f in functions]
    duration = max((s[-1] for s in stamps if len(s)), default=0.0)
    return Trace("maf2021", functions, float(duration), timestamps_s=stamps)


def load_trace(path: str | Path, trace_format: str) -> Trace:
    if trace_format == "maf2019":
        return load_maf2019(path)
    if trace_format == "maf2021":
        return load_maf2021(path)
    raise ValueError(f"trace_format={trace_format!r}: choose 'maf2019' or 'maf2021'")


@dataclass
class FittedTrace:
    """A Gamma process (rate, CV) per model per window."""

    model_names: list[str]
    window_s: float
    rates: np.ndarray  # [model, window], requests per second
    cvs: np.ndarray  # [model, window]

    def scaled(self, rate_scale: float = 1.0, cv_scale: float = 1.0) -> "FittedTrace":
        return FittedTrace(self.model_names, self.window_s, self.rates * rate_scale, self.cvs * cv_scale)

    def resample(self, slo_s: Sequence[float], seed: int = 0) -> Workload:
        """Draw a new workload: each (model, window) from its fitted Gamma process, one child seed each."""
        num_models, num_windows = self.rates.shape
        seeds = np.random.SeedSequence(seed).spawn(num_models * num_windows)
        arrivals, models = [], []
        for m in range(num_models):
            for w in range(num_windows):
                rate = self.rates[m, w]
                if rate <= 0:
                    continue
                rng = np.random.default_rng(seeds[m * num_windows + w])
                times = GammaProcess(rate, float(self.cvs[m, w])).generate(w * self.window_s, self.window_s, rng)
                arrivals.append(times)
                models.append(np.full(len(times), m))
        arrival = np.concatenate(arrivals) if arrivals else np.empty(0)
        model = np.concatenate(models) if models else np.empty(0, dtype=np.int64)
        order = np.argsort(arrival, kind="stable")
        slo = np.asarray(slo_s, dtype=float)
        return Workload(self.model_names, arrival[order], model[order],
                        slo[model[order]] if len(model) else np.empty(0))


def function_to_model(num_functions: int, num_models: int) -> np.ndarray:
    """Round robin: function i serves model i mod num_models (AlpaServe §6.2)."""
    return np.arange(num_functions) % num_models


def _cv_from_gaps(times: np.ndarray) -> float:
    gaps = np.diff(times)
    if len(gaps) < MIN_SAMPLES_FOR_CV or gaps.mean() <= 0:
        return DEFAULT_CV
    return float(np.clip(gaps.std() / gaps.mean(), MIN_FITTED_CV, MAX_FITTED_CV))


def _cv_from_counts(counts: np.ndarray) -> float:
    """CV of a renewal process from counts in equal bins: Var N(T) / E N(T) -> CV^2 for bins long against the
    mean gap (the asymptotic index of dispersion)."""
    if len(counts) < MIN_SAMPLES_FOR_CV or counts.mean() <= 0:
        return DEFAULT_CV
    return float(np.clip(np.sqrt(counts.var(ddof=1) / counts.mean()), MIN_FITTED_CV, MAX_FITTED_CV))


def fit_gamma_windows(trace: Trace, model_names: Sequence[str], window_s: float) -> FittedTrace:
    """Map functions to models round robin, cut the trace into windows, fit rate and CV per (model, window)."""
    if window_s <= 0:
        raise ValueError(f"window_s={window_s}: must be > 0")
    names = list(model_names)
    owner = function_to_model(len(trace.functions), len(names))
    num_windows = max(1, int(np.ceil(trace.duration_s / window_s)))
    rates = np.zeros((len(names), num_windows))
    cvs = np.full((len(names), num_windows), DEFAULT_CV)
    if trace.format == "maf2019":
        minutes_per_window = window_s / SECONDS_PER_MINUTE
        if minutes_per_window < 1 or abs(minutes_per_window - round(minutes_per_window)) > 1e-9:
            raise ValueError(f"window_s={window_s}: MAF 2019 windows must be whole minutes")
        per_window = int(round(minutes_per_window))
        counts = np.zeros((len(names), trace.counts_per_minute.shape[1]))
        np.add.at(counts, owner, trace.counts_per_minute)
        for w in range(num_windows):
            chunk = counts[:, w * per_window:(w + 1) * per_window]
            rates[:, w] = chunk.sum(axis=1) / window_s
            cvs[:, w] = [_cv_from_counts(row) for row in chunk]
    else:
        for m in range(len(names)):
            mine = [trace.timestamps_s[f] for f in np.flatnonzero(owner == m)]
            times = np.sort(np.concatenate(mine)) if mine else np.empty(0)
            edges = np.searchsorted(times, np.arange(num_windows + 1) * window_s)
            for w in range(num_windows):
                part = times[edges[w]:edges[w + 1]]
                rates[m, w] = len(part) / window_s
                cvs[m, w] = _cv_from_gaps(part)
    logger.info("fitted %d windows of %.0f s for %d models from %d functions", num_windows, window_s, len(names),
                len(trace.functions))
    return FittedTrace(names, window_s, rates, cvs)


def fit_arrivals(model_names: Sequence[str], arrival_s: Sequence[np.ndarray], window_s: float,
                 duration_s: float) -> FittedTrace:
    """Fit rate and CV per (model, window) from observed arrival times (seconds from the start of the observation),
    as `fit_gamma_windows` does for a MAF 2021 trace: the live controller's view of its own traffic."""
    if window_s <= 0 or duration_s <= 0:
        raise ValueError(f"window_s={window_s}, duration_s={duration_s}: both must be > 0")
    if len(arrival_s) != len(model_names):
        raise ValueError(f"{len(arrival_s)} arrival arrays for {len(model_names)} models")
    num_windows = max(1, int(np.ceil(duration_s / window_s - 1e-9)))
    rates = np.zeros((len(model_names), num_windows))
    cvs = np.full((len(model_names), num_windows), DEFAULT_CV)
    for m, times in enumerate(arrival_s):
        times = np.sort(np.asarray(times, dtype=float))
        edges = np.searchsorted(times, np.arange(num_windows + 1) * window_s)
        for w in range(num_windows):
            part = times[edges[w]:edges[w + 1]]
            span = min(window_s, duration_s - w * window_s)
            rates[m, w] = len(part) / span
            cvs[m, w] = _cv_from_gaps(part)
    return FittedTrace(list(model_names), window_s, rates, cvs)


def trace_workload(trace: Trace, model_names: Sequence[str], slo_s: Sequence[float], window_s: float = 60.0,
                   rate_scale: float = 1.0, cv_scale: float = 1.0, seed: int = 0) -> Workload:
    """Fit, scale and resample (AlpaServe §6.2)."""
    return fit_gamma_windows(trace, model_names, window_s).scaled(rate_scale, cv_scale).resample(slo_s, seed)
