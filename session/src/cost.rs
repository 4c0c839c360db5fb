//! Token usage and its price.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Prompt-cache lifetime: each hit refreshes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ttl {
    /// 5 minutes (the CLI's default); writes cost 1.25x base input.
    FiveMinutes,
    /// 1 hour (`CLAUDE_CODE_PROMPT_CACHE_TTL=1h`); writes cost 2x base input.
    OneHour,
}

impl Ttl {
    /// How long an entry lives after its last hit.
    pub fn duration(self) -> Duration {
        match self {
            Self::FiveMinutes => Duration::from_secs(300),
            Self::OneHour => Duration::from_secs(3600),
        }
    }
}

/// Prices in US dollars per million tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prices {
    /// Uncached input.
    pub input: f64,
    /// Cache write with a 5-minute TTL.
    pub cache_write_5m: f64,
    /// Cache write with a 1-hour TTL.
    pub cache_write_1h: f64,
    /// Cache read.
    pub cache_read: f64,
    /// Output (thinking included).
    pub output: f64,
}

impl Default for Prices {
    /// Anthropic's published ratios on a $3 base: writes 1.25x / 2x, reads 0.1x, output 5x.
    fn default() -> Self {
        Self::from_base(3.0, 0.1)
    }
}

impl Prices {
    /// A table from a base input price and a read ratio (0.1, or 0.05 on some newer models).
    pub fn from_base(base: f64, read_ratio: f64) -> Self {
        Self {
            input: base,
            cache_write_5m: base * 1.25,
            cache_write_1h: base * 2.0,
            cache_read: base * read_ratio,
            output: base * 5.0,
        }
    }

    /// The published table of a Claude model, by its name's family (dated and undated names
    /// alike: `claude-sonnet-4-5`, `claude-sonnet-4-5-20250929`), or `None` for a model it does
    /// not know. Every published model bills writes at 1.25x / 2x, reads at 0.1x and output at
    /// 5x its base input price; a model priced otherwise (reads at 0.05x, say) is configured
    /// with [`Prices::from_base`].
    pub fn for_model(model: &str) -> Option<Self> {
        // Most specific first: `claude-opus-4-5` before `claude-opus-4`.
        const BASES: &[(&str, f64)] = &[
            ("claude-opus-4-5", 5.0),
            ("claude-opus-4-6", 5.0),
            ("claude-opus-4", 15.0),
            ("claude-3-opus", 15.0),
            ("claude-sonnet-4", 3.0),
            ("claude-3-7-sonnet", 3.0),
            ("claude-3-5-sonnet", 3.0),
            ("claude-haiku-4-5", 1.0),
            ("claude-3-5-haiku", 0.8),
            ("claude-3-haiku", 0.25),
        ];
        BASES
            .iter()
            .find(|(family, _)| {
                model == *family
                    || model
                        .strip_prefix(family)
                        .is_some_and(|rest| rest.starts_with('-') || rest.starts_with('@'))
            })
            .map(|&(_, base)| Self::from_base(base, 0.1))
    }

    /// Price of one cache write token under `ttl`.
    pub fn write(&self, ttl: Ttl) -> f64 {
        match ttl {
            Ttl::FiveMinutes => self.cache_write_5m,
            Ttl::OneHour => self.cache_write_1h,
        }
    }

    /// Dollars for `tokens` at `per_million`.
    pub fn dollars(tokens: u64, per_million: f64) -> f64 {
        tokens as f64 * per_million / 1e6
    }
}

/// One request's usage, as the API reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Uncached input tokens.
    pub input: u64,
    /// Tokens read from the cache.
    pub cache_read: u64,
    /// Tokens written with a 5-minute TTL.
    pub cache_write_5m: u64,
    /// Tokens written with a 1-hour TTL.
    pub cache_write_1h: u64,
    /// Output tokens.
    pub output: u64,
}

impl Usage {
    /// Every prompt token, however billed: the size of the prefix sent.
    pub fn prompt_tokens(&self) -> u64 {
        self.input + self.cache_read + self.cache_write_5m + self.cache_write_1h
    }

    /// Share of prompt tokens read from the cache (0 when there were none).
    pub fn hit_ratio(&self) -> f64 {
        match self.prompt_tokens() {
            0 => 0.0,
            n => self.cache_read as f64 / n as f64,
        }
    }

    /// What it costs under `p`.
    pub fn cost(&self, p: &Prices) -> f64 {
        Prices::dollars(self.input, p.input)
            + Prices::dollars(self.cache_read, p.cache_read)
            + Prices::dollars(self.cache_write_5m, p.cache_write_5m)
            + Prices::dollars(self.cache_write_1h, p.cache_write_1h)
            + Prices::dollars(self.output, p.output)
    }

    /// Adds another request's usage.
    pub fn add(&mut self, o: &Usage) {
        self.input += o.input;
        self.cache_read += o.cache_read;
        self.cache_write_5m += o.cache_write_5m;
        self.cache_write_1h += o.cache_write_1h;
        self.output += o.output;
    }

    /// What was used between two cumulative counts, `earlier` and `self`; `None` if any count
    /// went down (they are not the same running total).
    pub fn since(&self, earlier: &Usage) -> Option<Usage> {
        Some(Usage {
            input: self.input.checked_sub(earlier.input)?,
            cache_read: self.cache_read.checked_sub(earlier.cache_read)?,
            cache_write_5m: self.cache_write_5m.checked_sub(earlier.cache_write_5m)?,
            cache_write_1h: self.cache_write_1h.checked_sub(earlier.cache_write_1h)?,
            output: self.output.checked_sub(earlier.output)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_between_two_running_totals() {
        let earlier = Usage {
            input: 2,
            cache_read: 810,
            cache_write_5m: 62,
            cache_write_1h: 0,
            output: 24,
        };
        let now = Usage {
            input: 1769,
            cache_read: 1277,
            cache_write_5m: 80,
            cache_write_1h: 0,
            output: 36,
        };
        let d = now.since(&earlier).unwrap();
        assert_eq!(
            (d.input, d.cache_read, d.cache_write_5m, d.output),
            (1767, 467, 18, 12)
        );
        let mut back = earlier;
        back.add(&d);
        assert_eq!(back, now);
        // Not the same running total: a count went down.
        assert_eq!(earlier.since(&now), None);
        assert_eq!(now.since(&now), Some(Usage::default()));
    }

    #[test]
    fn billing_follows_the_published_ratios() {
        let p = Prices::default();
        let u = Usage {
            input: 1_000_000,
            cache_read: 1_000_000,
            cache_write_5m: 1_000_000,
            cache_write_1h: 1_000_000,
            output: 1_000_000,
        };
        let c = u.cost(&p);
        assert!((c - (3.0 + 0.3 + 3.75 + 6.0 + 15.0)).abs() < 1e-9, "{c}");
        assert_eq!(u.prompt_tokens(), 4_000_000);
        assert!((u.hit_ratio() - 0.25).abs() < 1e-12);
        assert_eq!(Usage::default().hit_ratio(), 0.0);
        assert_eq!(p.write(Ttl::OneHour), 6.0);
        assert_eq!(Ttl::FiveMinutes.duration(), Duration::from_secs(300));
    }

    #[test]
    fn models_have_their_published_prices() {
        let base = |m: &str| Prices::for_model(m).map(|p| p.input);
        assert_eq!(base("claude-sonnet-4-5"), Some(3.0));
        assert_eq!(base("claude-sonnet-4-5-20250929"), Some(3.0));
        assert_eq!(base("claude-sonnet-4-6"), Some(3.0));
        assert_eq!(base("claude-opus-4-1-20250805"), Some(15.0));
        assert_eq!(base("claude-opus-4-5"), Some(5.0));
        assert_eq!(base("claude-opus-4-6"), Some(5.0));
        assert_eq!(base("claude-haiku-4-5"), Some(1.0));
        assert_eq!(base("claude-3-5-haiku-20241022"), Some(0.8));
        assert_eq!(base("claude-3-haiku-20240307"), Some(0.25));
        // Not a family name's prefix match by accident, nor a stranger.
        assert_eq!(base("claude-opus-40"), None);
        assert_eq!(base("gpt-4o"), None);
        let haiku = Prices::for_model("claude-haiku-4-5").unwrap();
        assert_eq!(
            (
                haiku.cache_write_5m,
                haiku.cache_write_1h,
                haiku.cache_read,
                haiku.output
            ),
            (1.25, 2.0, 0.1, 5.0)
        );
        let cheap = Prices::from_base(3.0, 0.05);
        assert!((cheap.cache_read - 0.15).abs() < 1e-12);
    }
}
