//! Deciding a bench cell from paired rounds: each round runs the baseline, the library, and the
//! baseline again, and gives one ratio (the library over the mean of the two baseline runs, so
//! that drift between rounds falls on both sides). The cell's figure is the median ratio; its
//! 95% confidence interval comes from the order statistics alone (no assumption about how the
//! ratios are spread), so a cell below its target is called a finding only when the whole
//! interval is below it.

use std::fmt;

/// The median of a cell's per-round values, its 95% confidence interval and their range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Rounds (finite values only).
    pub n: usize,
    /// The median (the mean of the middle two for an even count).
    pub median: f64,
    /// A distribution-free 95% confidence interval for the median: `[x(k), x(n+1-k)]` of the
    /// sorted values, `k` the largest with `2 P(Bin(n, 1/2) < k) <= 0.05`. `None` under six
    /// rounds, where even the full range covers the median with less than 95% confidence.
    pub ci: Option<(f64, f64)>,
    /// The smallest and largest value.
    pub range: (f64, f64),
}

impl Summary {
    /// The summary of `values` (non-finite ones are left out); `None` when none is finite.
    pub fn of(values: &[f64]) -> Option<Summary> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        let ci = rank(n).map(|k| (v[k - 1], v[n - k]));
        Some(Summary {
            n,
            median,
            ci,
            range: (v[0], v[n - 1]),
        })
    }

    /// Whether the median clears `target` (at least it), is shown below it (the whole
    /// confidence interval under it), or neither.
    pub fn at_least(&self, target: f64) -> Verdict {
        if self.median >= target {
            Verdict::Meets
        } else if self.ci.is_some_and(|(_, hi)| hi < target) {
            Verdict::Misses
        } else {
            Verdict::Undecided
        }
    }

    /// As [`at_least`](Self::at_least), for a figure that must stay at or under `target`
    /// (a time): [`Verdict::Misses`] when the whole interval is over it.
    pub fn at_most(&self, target: f64) -> Verdict {
        if self.median <= target {
            Verdict::Meets
        } else if self.ci.is_some_and(|(lo, _)| lo > target) {
            Verdict::Misses
        } else {
            Verdict::Undecided
        }
    }
}

impl fmt::Display for Summary {
    /// `median [ci lo..ci hi] (lowest..highest) nN`, two decimals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} ", self.median)?;
        match self.ci {
            Some((lo, hi)) => write!(f, "[{lo:.2}..{hi:.2}]")?,
            None => write!(f, "[-]")?,
        }
        write!(f, " ({:.2}..{:.2}) n{}", self.range.0, self.range.1, self.n)
    }
}

/// What a cell's rounds say about its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The median meets the target.
    Meets,
    /// The median misses it and so does the whole 95% confidence interval: a finding.
    Misses,
    /// The median misses it but the interval reaches it, or there are too few rounds for an
    /// interval: noise cannot be told from a shortfall in these rounds (more rounds decide).
    Undecided,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Meets => "ok",
            Verdict::Misses => "MISSES",
            Verdict::Undecided => "undecided",
        })
    }
}

/// The 1-based rank `k` of the lower end of the median's 95% interval over `n` values: the
/// largest with `2 P(B <= k - 1) <= 0.05`, `B ~ Bin(n, 1/2)`; `None` when even `k = 1` fails.
fn rank(n: usize) -> Option<usize> {
    // P(B <= j) summed in log space: 0.5^n underflows past n = 1074.
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    let mut ln_choose = 0.0f64; // ln C(n, 0)
    let mut cdf = 0.0f64;
    let mut k = None;
    for j in 0..n {
        cdf += (ln_choose + ln_half_n).exp();
        if 2.0 * cdf > 0.05 {
            break;
        }
        // P(B <= j) passes: the interval may start at rank j + 1.
        k = Some(j + 1);
        ln_choose += ((n - j) as f64).ln() - ((j + 1) as f64).ln();
    }
    k
}

/// One round's ratio: the library's rate over the mean of the baseline's rates before and after
/// it (rates: bigger is faster, GB/s or 1/seconds).
pub fn ratio(before: f64, ours: f64, after: f64) -> f64 {
    ours / ((before + after) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_match_the_binomial_tables() {
        // From the exact binomial: n = 6..9 -> 1, 1, 1, 2 (n = 9: 2 P(B <= 1) = 20/512);
        // n = 20 -> 6 (2 P(B <= 5) = 0.041, 2 P(B <= 6) = 0.115); n = 100 -> 40.
        assert_eq!(rank(5), None);
        assert_eq!(rank(6), Some(1));
        assert_eq!(rank(8), Some(1));
        assert_eq!(rank(9), Some(2));
        assert_eq!(rank(20), Some(6));
        assert_eq!(rank(100), Some(40));
        // Large n does not underflow: about n/2 - 0.98 sqrt(n).
        let k = rank(2000).unwrap();
        assert!((956..=958).contains(&k), "{k}");
    }

    #[test]
    fn a_summary_sorts_and_picks_its_ranks() {
        let v = [0.9, 1.3, 0.7, 1.1, 1.0, 0.8, 1.2, 0.95, 1.05];
        let s = Summary::of(&v).unwrap();
        assert_eq!(s.n, 9);
        assert_eq!(s.median, 1.0);
        assert_eq!(s.ci, Some((0.8, 1.2)));
        assert_eq!(s.range, (0.7, 1.3));
        assert_eq!(s.to_string(), "1.00 [0.80..1.20] (0.70..1.30) n9");
        let even = Summary::of(&[4.0, 1.0, f64::NAN, 3.0, 2.0]).unwrap();
        assert_eq!((even.n, even.median, even.ci), (4, 2.5, None));
        assert_eq!(Summary::of(&[f64::INFINITY]), None);
    }

    #[test]
    fn verdicts_need_the_whole_interval_for_a_miss() {
        // Nine rounds, all under 0.97: a miss.
        let low: Vec<f64> = (0..9).map(|i| 0.90 + i as f64 * 0.005).collect();
        assert_eq!(Summary::of(&low).unwrap().at_least(0.97), Verdict::Misses);
        // The median under, the interval's top over: undecided.
        let mixed = [0.90, 0.92, 0.94, 0.95, 0.96, 0.96, 0.99, 1.00, 1.02];
        assert_eq!(
            Summary::of(&mixed).unwrap().at_least(0.97),
            Verdict::Undecided
        );
        assert_eq!(Summary::of(&mixed).unwrap().at_least(0.96), Verdict::Meets);
        // Too few rounds never make a finding.
        assert_eq!(
            Summary::of(&[0.5, 0.5, 0.5]).unwrap().at_least(0.97),
            Verdict::Undecided
        );
        // At most: microseconds over a budget.
        let us = [0.6, 0.7, 0.8, 0.65, 0.9, 0.75, 0.7, 0.8, 0.6];
        assert_eq!(Summary::of(&us).unwrap().at_most(0.5), Verdict::Misses);
        assert_eq!(Summary::of(&us).unwrap().at_most(0.75), Verdict::Meets);
        assert_eq!(Summary::of(&us).unwrap().at_most(0.68), Verdict::Undecided);
    }

    #[test]
    fn a_ratio_is_against_the_mean_of_both_baselines() {
        assert_eq!(ratio(2.0, 3.0, 4.0), 1.0);
        assert_eq!(ratio(1.0, 0.5, 1.0), 0.5);
    }
}
