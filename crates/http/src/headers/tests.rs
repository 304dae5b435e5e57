use super::*;
use http::HeaderValue;
use proptest::prelude::*;

const YEAR: Duration = DEFAULT_MAX_PLAUSIBLE;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn ms(m: u64) -> Duration {
    Duration::from_millis(m)
}

fn at(unix_secs: u64) -> SystemTime {
    UNIX_EPOCH + secs(unix_secs)
}

/// 1994-11-06T08:49:00Z, 37 s before the HTTP-date examples of RFC 9110.
const RFC_NOW: u64 = 784_111_777 - 37;
/// 2026-11-30T12:00:00Z.
const NOV_30: u64 = 1_796_040_000;

fn map(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        headers.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    headers
}

#[test]
fn retry_after_delta_seconds() {
    let now = at(NOV_30);
    let cases: &[(&str, Result<Duration, Malformed>)] = &[
        ("0", Ok(Duration::ZERO)),
        ("120", Ok(secs(120))),
        ("007", Ok(secs(7))),
        (" 5 ", Ok(secs(5))),
        ("\t9\t", Ok(secs(9))),
        ("1.5", Ok(ms(1_500))),
        ("0.000000001", Ok(Duration::from_nanos(1))),
        ("1.0000000009", Ok(secs(1))),
        ("31622400", Ok(YEAR)),
        ("", Err(Malformed::Empty)),
        ("   ", Err(Malformed::Empty)),
        ("-1", Err(Malformed::Negative)),
        ("-0", Err(Malformed::Negative)),
        ("-99999999999999999999999", Err(Malformed::Negative)),
        ("-", Err(Malformed::NotANumber)),
        ("--5", Err(Malformed::NotANumber)),
        ("+5", Err(Malformed::NotANumber)),
        ("5s", Err(Malformed::NotANumber)),
        ("1e3", Err(Malformed::NotANumber)),
        ("5.", Err(Malformed::NotANumber)),
        (".5", Err(Malformed::NotANumber)),
        ("1.2.3", Err(Malformed::NotANumber)),
        ("5, 10", Err(Malformed::NotANumber)),
        ("31622401", Err(Malformed::TooFar)),
        ("999999999", Err(Malformed::TooFar)),
        ("18446744073709551615", Err(Malformed::TooFar)),
        ("18446744073709551616", Err(Malformed::Overflow)),
        ("99999999999999999999999999999999", Err(Malformed::Overflow)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_retry_after(text.as_bytes(), now, YEAR), *want, "{text:?}");
    }
    assert_eq!(parse_retry_after(b"\xff", now, YEAR), Err(Malformed::BadHttpDate));
    assert_eq!(parse_retry_after(b"5\xff", now, YEAR), Err(Malformed::NotANumber));
    assert_eq!(parse_retry_after(b"5", now, secs(4)), Err(Malformed::TooFar));
}

#[test]
fn retry_after_all_three_http_date_forms() {
    let now = at(RFC_NOW);
    for form in [
        "Sun, 06 Nov 1994 08:49:37 GMT",  // IMF-fixdate
        "Sunday, 06-Nov-94 08:49:37 GMT", // obsolete RFC 850
        "Sun Nov  6 08:49:37 1994",       // ANSI C asctime()
        "  Sun, 06 Nov 1994 08:49:37 GMT\t",
    ] {
        assert_eq!(parse_retry_after(form.as_bytes(), now, YEAR), Ok(secs(37)), "{form}");
        assert_eq!(
            parse_reset(form.as_bytes(), ResetFormat::HttpDate, now, YEAR),
            Ok(secs(37)),
            "{form}"
        );
    }
    // A date in the past is "now"; sub-second wall clocks round the wait down.
    assert_eq!(parse_retry_after(b"Sun, 06 Nov 1994 08:48:00 GMT", now, YEAR), Ok(Duration::ZERO));
    assert_eq!(
        parse_retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT", now + ms(250), YEAR),
        Ok(ms(36_750))
    );
    let bad = Err(Malformed::BadHttpDate);
    for text in [
        "Mon, 06 Nov 1994 08:49:37 GMT", // wrong weekday
        "Sun, 06 Nov 1994 08:49:37 UTC",
        "Sun, 06 Nov 1994 08:49:37 gmt",
        "Sun, 06 Nov 1994 24:00:00 GMT",
        "Thu, 30 Feb 1995 08:49:37 GMT",
        "Sun, 6 Nov 1994 08:49:37 GMT",
        "Sun, 06 Nov 1994",
        "Sun Nov 6 08:49:37 1994",
        "Thu, 01 Jan 1969 00:00:00 GMT",
        "soon",
        "Sun, 06 Nov 1994 08:49:37 GMT, Sun, 06 Nov 1994 08:49:37 GMT",
    ] {
        assert_eq!(parse_retry_after(text.as_bytes(), now, YEAR), bad, "{text}");
    }
    assert_eq!(parse_retry_after("Sün, 06 Nov".as_bytes(), now, YEAR), bad);
    // Years away: implausible.
    assert_eq!(
        parse_retry_after(b"Fri, 31 Dec 9999 23:59:59 GMT", now, YEAR),
        Err(Malformed::TooFar)
    );
}

#[test]
fn retry_after_ms() {
    let cases: &[(&str, Result<Duration, Malformed>)] = &[
        ("1500", Ok(ms(1_500))),
        ("0", Ok(Duration::ZERO)),
        (" 20 ", Ok(ms(20))),
        ("1500.5", Ok(Duration::from_micros(1_500_500))),
        ("31622400000", Ok(YEAR)),
        ("31622400001", Err(Malformed::TooFar)),
        ("-5", Err(Malformed::Negative)),
        ("abc", Err(Malformed::NotANumber)),
        ("1.5s", Err(Malformed::NotANumber)),
        ("", Err(Malformed::Empty)),
        ("184467440737095516150", Err(Malformed::Overflow)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_retry_after_ms(text.as_bytes(), YEAR), *want, "{text:?}");
    }
}

#[test]
fn grpc_pushback_follows_grfc_a6() {
    use Pushback::{DontRetry, RetryAfter};
    let cases: &[(&str, Result<Pushback, Malformed>)] = &[
        ("100", Ok(RetryAfter(ms(100)))),
        ("0", Ok(RetryAfter(Duration::ZERO))),
        ("+5", Ok(RetryAfter(ms(5)))),
        ("-0", Ok(RetryAfter(Duration::ZERO))),
        ("-1", Ok(DontRetry)),
        ("-9223372036854775807", Ok(DontRetry)),
        ("9223372036854775807", Ok(RetryAfter(ms(i64::MAX as u64)))),
        ("9223372036854775808", Err(Malformed::Overflow)),
        ("-99999999999999999999999", Err(Malformed::Overflow)),
        ("1.5", Err(Malformed::NotANumber)),
        ("abc", Err(Malformed::NotANumber)),
        ("-", Err(Malformed::NotANumber)),
        ("", Err(Malformed::Empty)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_grpc_pushback(text.as_bytes()), *want, "{text:?}");
    }
}

#[test]
fn counts() {
    let cases: &[(&str, Result<u64, Malformed>)] = &[
        ("0", Ok(0)),
        ("42", Ok(42)),
        (" 42 ", Ok(42)),
        ("18446744073709551615", Ok(u64::MAX)),
        ("18446744073709551616", Err(Malformed::Overflow)),
        ("-1", Err(Malformed::Negative)),
        ("1.0", Err(Malformed::NotANumber)),
        ("10, 10", Err(Malformed::NotANumber)),
        ("ten", Err(Malformed::NotANumber)),
        ("", Err(Malformed::Empty)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_count(text.as_bytes()), *want, "{text:?}");
    }
}

#[test]
fn go_durations() {
    let cases: &[(&str, Result<Duration, Malformed>)] = &[
        ("6m0s", Ok(secs(360))),
        ("1h", Ok(secs(3_600))),
        ("1.5s", Ok(ms(1_500))),
        ("300ms", Ok(ms(300))),
        ("2h45m", Ok(secs(9_900))),
        ("1h2m3.5s", Ok(ms(3_723_500))),
        ("1h0m0s", Ok(secs(3_600))),
        ("7.66s", Ok(ms(7_660))),
        ("0", Ok(Duration::ZERO)),
        ("0s", Ok(Duration::ZERO)),
        ("-0", Ok(Duration::ZERO)),
        ("+1s", Ok(secs(1))),
        (" 20ms ", Ok(ms(20))),
        ("1.5µs", Ok(Duration::from_nanos(1_500))),
        ("1μs", Ok(Duration::from_micros(1))),
        ("1us", Ok(Duration::from_micros(1))),
        ("10ns", Ok(Duration::from_nanos(10))),
        (".5s", Ok(ms(500))),
        ("1.s", Ok(secs(1))),
        ("1s1s", Ok(secs(2))),
        ("1.0000000009s", Ok(secs(1))),
        ("0.1h", Ok(secs(360))),
        ("", Err(Malformed::Empty)),
        ("-1s", Err(Malformed::Negative)),
        ("6", Err(Malformed::BadDuration)),
        ("1.5", Err(Malformed::BadDuration)),
        ("s", Err(Malformed::BadDuration)),
        ("6x", Err(Malformed::BadDuration)),
        ("6S", Err(Malformed::BadDuration)),
        ("1 s", Err(Malformed::BadDuration)),
        ("1h-1m", Err(Malformed::BadDuration)),
        (".s", Err(Malformed::BadDuration)),
        ("..5s", Err(Malformed::BadDuration)),
        ("+", Err(Malformed::BadDuration)),
        ("1d", Err(Malformed::BadDuration)),
        ("99999999999999999999s", Err(Malformed::Overflow)),
        ("9999999999999999999h", Err(Malformed::Overflow)),
        ("18446744073709551615ns", Ok(Duration::from_nanos(u64::MAX))),
        ("18446744073709551615ns1ns", Err(Malformed::Overflow)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_go_duration(text.as_bytes()), *want, "{text:?}");
    }
    assert_eq!(parse_go_duration(b"1\xffs"), Err(Malformed::BadDuration));
    // As a reset, it is a wait from now, held to max_plausible.
    let now = at(NOV_30);
    assert_eq!(parse_reset(b"6m0s", ResetFormat::GoDuration, now, YEAR), Ok(secs(360)));
    assert_eq!(
        parse_reset(b"8784h0m1s", ResetFormat::GoDuration, now, YEAR),
        Err(Malformed::TooFar)
    );
}

#[test]
fn rfc3339_dates() {
    let t = |s: &str| parse_rfc3339(s.as_bytes());
    let nov_30 = at(NOV_30);
    for same in [
        "2026-11-30T12:00:00Z",
        "2026-11-30t12:00:00z",
        "2026-11-30 12:00:00Z",
        "2026-11-30T13:00:00+01:00",
        "2026-11-30T06:30:00-05:30",
        "2026-12-01T11:59:00+23:59",
        "2026-11-30T12:00:00-00:00",
        "2026-11-30T12:00:00.000Z",
        " 2026-11-30T12:00:00Z ",
    ] {
        assert_eq!(t(same), Ok(nov_30), "{same}");
    }
    assert_eq!(t("2026-11-30T12:00:00.25Z"), Ok(nov_30 + ms(250)));
    assert_eq!(
        t("2026-11-30T12:00:00.123456789123Z"),
        Ok(nov_30 + Duration::from_nanos(123_456_789))
    );
    assert_eq!(t("1970-01-01T00:00:00Z"), Ok(UNIX_EPOCH));
    assert_eq!(t("2024-02-29T00:00:00Z"), Ok(at(1_709_164_800)));
    assert_eq!(t("2000-02-29T00:00:00Z"), Ok(at(951_782_400)));
    assert_eq!(t("2026-11-30T11:59:60Z"), Ok(nov_30)); // a leap second
    assert_eq!(t("1969-12-31T23:59:59Z"), Ok(UNIX_EPOCH - secs(1)));
    assert_eq!(t(""), Err(Malformed::Empty));
    for bad in [
        "2026-13-01T00:00:00Z",
        "2026-00-01T00:00:00Z",
        "2026-11-00T00:00:00Z",
        "2026-04-31T00:00:00Z",
        "2023-02-29T00:00:00Z",
        "1900-02-29T00:00:00Z",
        "2026-11-30T24:00:00Z",
        "2026-11-30T12:60:00Z",
        "2026-11-30T12:00:61Z",
        "2026-11-30T12:00:00",
        "2026-11-30",
        "2026-11-30T12:00Z",
        "2026-11-30T12:00:00+0100",
        "2026-11-30T12:00:00+24:00",
        "2026-11-30T12:00:00+01:60",
        "2026-11-30T12:00:00.Z",
        "2026-11-30T12:00:00ZZ",
        "2026-11-30X12:00:00Z",
        "2026/11/30T12:00:00Z",
        "+2026-11-30T12:00:00Z",
        "26-11-30T12:00:00Z",
        "2026-1-30T12:00:00Z",
        "2026-11-30T12:00:00 Z",
        "１０26-11-30T12:00:00Z",
    ] {
        assert_eq!(t(bad), Err(Malformed::BadRfc3339), "{bad}");
    }

    let wait = |s: &str, now| parse_reset(s.as_bytes(), ResetFormat::Rfc3339, now, YEAR);
    assert_eq!(wait("2026-11-30T12:00:30Z", nov_30), Ok(secs(30)));
    assert_eq!(wait("2026-11-30T11:00:00Z", nov_30), Ok(Duration::ZERO));
    // Go's zero time, which Go servers send for "no reset": long past, so "now".
    assert_eq!(wait("0001-01-01T00:00:00Z", nov_30), Ok(Duration::ZERO));
    assert_eq!(wait("9999-12-31T23:59:59Z", nov_30), Err(Malformed::TooFar));
    assert_eq!(wait("2027-12-01T12:00:00Z", nov_30), Ok(YEAR));
    assert_eq!(wait("2027-12-01T12:00:00.000000001Z", nov_30), Err(Malformed::TooFar));
}

#[test]
fn unix_or_delta_splits_at_ten_to_the_ninth() {
    // 2027-01-15T08:00:00Z.
    let now = at(1_800_000_000);
    let far = LONGEST_MAX_PLAUSIBLE;
    let read = |s: &str, max| parse_reset(s.as_bytes(), ResetFormat::UnixOrDelta, now, max);
    assert_eq!(read("999999999", far), Ok(secs(999_999_999)));
    assert_eq!(read("999999999", YEAR), Err(Malformed::TooFar));
    assert_eq!(read("999999999.9", far), Ok(secs(999_999_999) + ms(900)));
    assert_eq!(read("1000000000", far), Ok(Duration::ZERO)); // 2001: long past
    assert_eq!(read("60", YEAR), Ok(secs(60)));
    assert_eq!(read("0", YEAR), Ok(Duration::ZERO));
    assert_eq!(read("1800000060", YEAR), Ok(secs(60)));
    assert_eq!(read("1800000060.5", YEAR), Ok(ms(60_500)));
    assert_eq!(read("1799999999", YEAR), Ok(Duration::ZERO));
    // Unix milliseconds read as seconds: thousands of years away.
    assert_eq!(read("1800000060000", YEAR), Err(Malformed::TooFar));
    assert_eq!(read("-60", YEAR), Err(Malformed::Negative));
    assert_eq!(read("6m0s", YEAR), Err(Malformed::NotANumber));
}

#[test]
fn each_reset_format() {
    let now = at(1_800_000_000);
    let read = |s: &str, f| parse_reset(s.as_bytes(), f, now, YEAR);
    assert_eq!(read("1800000030", ResetFormat::UnixSeconds), Ok(secs(30)));
    assert_eq!(read("0", ResetFormat::UnixSeconds), Ok(Duration::ZERO));
    assert_eq!(read("30", ResetFormat::UnixSeconds), Ok(Duration::ZERO));
    assert_eq!(read("1800000030500", ResetFormat::UnixMillis), Ok(ms(30_500)));
    assert_eq!(read("1800000030", ResetFormat::UnixMillis), Ok(Duration::ZERO));
    assert_eq!(read("1800000030", ResetFormat::DeltaSeconds), Err(Malformed::TooFar));
    assert_eq!(read("30", ResetFormat::DeltaSeconds), Ok(secs(30)));
    assert_eq!(read("Fri, 15 Jan 2027 08:00:30 GMT", ResetFormat::HttpDate), Ok(secs(30)));
    assert_eq!(read("30", ResetFormat::HttpDate), Err(Malformed::BadHttpDate));
    assert_eq!(read("2027-01-15T08:00:30Z", ResetFormat::Rfc3339), Ok(secs(30)));
    assert_eq!(read("30s", ResetFormat::GoDuration), Ok(secs(30)));
    for format in ResetFormat::ALL {
        assert!(read("", format).is_err(), "{format}");
        assert_eq!(format.as_str().parse::<ResetFormat>(), Ok(format));
        assert_eq!(format.to_string(), format.as_str());
    }
    assert_eq!(" rfc3339 ".parse::<ResetFormat>(), Ok(ResetFormat::Rfc3339));
    let err = "iso8601".parse::<ResetFormat>().unwrap_err();
    assert!(err.to_string().starts_with("`iso8601` is not a reset format"), "{err}");
}

#[test]
fn a_wall_clock_before_the_epoch_still_works() {
    let now = UNIX_EPOCH - secs(10);
    assert_eq!(parse_reset(b"0", ResetFormat::UnixSeconds, now, YEAR), Ok(secs(10)));
    assert_eq!(parse_reset(b"1969-12-31T23:59:55Z", ResetFormat::Rfc3339, now, YEAR), Ok(secs(5)));
}

#[test]
fn malformed_messages_are_lowercase_without_a_period() {
    for m in [
        Malformed::Empty,
        Malformed::NotANumber,
        Malformed::Negative,
        Malformed::Overflow,
        Malformed::TooFar,
        Malformed::BadHttpDate,
        Malformed::BadRfc3339,
        Malformed::BadDuration,
    ] {
        let text = m.to_string();
        assert!(text.chars().next().unwrap().is_lowercase() && !text.ends_with('.'), "{text}");
    }
}

// ---- readers ------------------------------------------------------------------------------

fn pushback_of(pairs: &[(&str, &str)], status: u16) -> (Option<Pushback>, HeaderStatsSnapshot) {
    let stats = HeaderStats::new();
    let status = StatusCode::from_u16(status).unwrap();
    let p = PushbackHeaders::default().read_pushback(&map(pairs), status, at(NOV_30), &stats);
    (p, stats.snapshot())
}

fn after(d: Duration) -> Option<Pushback> {
    Some(Pushback::RetryAfter(d))
}

/// The upstream's own `x-should-retry` (OpenAI's, Anthropic's): `false` is "do not retry" on
/// any status and beats a wait; `true` asks nothing; anything else is ignored and counted.
#[test]
fn x_should_retry_false_is_do_not_retry() {
    assert_eq!(pushback_of(&[("x-should-retry", "false")], 500).0, Some(Pushback::DontRetry));
    let both = [("x-should-retry", " FALSE "), ("retry-after", "5")];
    assert_eq!(pushback_of(&both, 429).0, Some(Pushback::DontRetry));
    assert_eq!(pushback_of(&[("x-should-retry", "true")], 503).0, None);
    let (p, stats) = pushback_of(&[("x-should-retry", "maybe")], 503);
    assert_eq!(p, None);
    assert_eq!(stats.get(HeaderKind::ShouldRetry), 1);
}

#[test]
fn retry_after_counts_on_429_and_503_only() {
    for status in [429, 503] {
        assert_eq!(pushback_of(&[("Retry-After", "3")], status).0, after(secs(3)));
        assert_eq!(pushback_of(&[("retry-after-ms", "250")], status).0, after(ms(250)));
        assert_eq!(pushback_of(&[("x-ms-retry-after-ms", "250")], status).0, after(ms(250)));
    }
    for status in [200, 302, 400, 500, 502, 504] {
        let (p, stats) = pushback_of(&[("retry-after", "3"), ("retry-after-ms", "x")], status);
        assert_eq!(p, None, "{status}");
        // Not read, so not counted.
        assert_eq!(stats.total(), 0);
    }
    assert_eq!(
        pushback_of(&[("retry-after", "Mon, 30 Nov 2026 12:00:10 GMT")], 503).0,
        after(secs(10))
    );
}

#[test]
fn the_strictest_statement_wins() {
    // Several explicit waits: the longest.
    assert_eq!(
        pushback_of(&[("retry-after", "2"), ("retry-after-ms", "2500")], 429).0,
        after(ms(2_500))
    );
    assert_eq!(
        pushback_of(&[("retry-after", "1"), ("retry-after", "4"), ("retry-after", "2")], 429).0,
        after(secs(4))
    );
    // A gRPC don't-retry beats any wait.
    assert_eq!(
        pushback_of(&[("retry-after", "1"), ("grpc-retry-pushback-ms", "-1")], 429).0,
        Some(Pushback::DontRetry)
    );
    assert_eq!(
        pushback_of(&[("retry-after", "1"), ("grpc-retry-pushback-ms", "3000")], 429).0,
        after(secs(3))
    );
    // An explicit wait beats the reset headers, even a longer one.
    assert_eq!(
        pushback_of(&[("retry-after", "1"), ("x-ratelimit-reset-requests", "6m0s")], 429).0,
        after(secs(1))
    );
    // A malformed explicit wait leaves the resets to speak.
    let (p, stats) =
        pushback_of(&[("retry-after", "soon"), ("x-ratelimit-reset-requests", "6m0s")], 429);
    assert_eq!(p, after(secs(360)));
    assert_eq!(stats.get(HeaderKind::RetryAfter), 1);
    // Several lines: the bad one counted, the good one used.
    let (p, stats) = pushback_of(&[("retry-after", "-1"), ("retry-after", "5")], 503);
    assert_eq!(p, after(secs(5)));
    assert_eq!(stats.get(HeaderKind::RetryAfter), 1);
}

#[test]
fn grpc_pushback_on_any_status() {
    for status in [200, 429, 503] {
        assert_eq!(pushback_of(&[("grpc-retry-pushback-ms", "150")], status).0, after(ms(150)));
        for dont in ["-1", "-300"] {
            let (p, stats) = pushback_of(&[("grpc-retry-pushback-ms", dont)], status);
            assert_eq!(p, Some(Pushback::DontRetry));
            assert_eq!(stats.total(), 0, "a negative pushback is not malformed");
        }
        for garbage in ["", "abc", "1.5", "99999999999999999999"] {
            let (p, stats) = pushback_of(&[("grpc-retry-pushback-ms", garbage)], status);
            assert_eq!(p, Some(Pushback::DontRetry), "{garbage:?}");
            assert_eq!(stats.get(HeaderKind::GrpcPushback), 1);
        }
    }
    // Several values: do not retry (as grpc-go reads A6).
    let (p, stats) =
        pushback_of(&[("grpc-retry-pushback-ms", "10"), ("grpc-retry-pushback-ms", "20")], 200);
    assert_eq!(p, Some(Pushback::DontRetry));
    assert_eq!(stats.get(HeaderKind::GrpcPushback), 1);
}

#[test]
fn provider_reset_headers() {
    // OpenAI style: Go durations, one per limit.
    assert_eq!(pushback_of(&[("x-ratelimit-reset-requests", "6m0s")], 429).0, after(secs(360)));
    assert_eq!(pushback_of(&[("x-ratelimit-reset-tokens", "7.66s")], 429).0, after(ms(7_660)));
    // Anthropic style: RFC 3339.
    assert_eq!(
        pushback_of(&[("anthropic-ratelimit-tokens-reset", "2026-11-30T12:00:42Z")], 429).0,
        after(secs(42))
    );
    // Both windows given, no remaining counters: the longer.
    let both = [("x-ratelimit-reset-requests", "1s"), ("x-ratelimit-reset-tokens", "6m0s")];
    assert_eq!(pushback_of(&both, 429).0, after(secs(360)));
    // With counters: only the exhausted window's reset counts.
    let paired = [
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-tokens", "6m0s"),
        ("x-ratelimit-remaining-tokens", "15000"),
    ];
    assert_eq!(pushback_of(&paired, 429).0, after(secs(1)));
    let anthropic = [
        ("anthropic-ratelimit-requests-reset", "2026-11-30T12:00:01Z"),
        ("anthropic-ratelimit-requests-remaining", "3"),
        ("anthropic-ratelimit-tokens-reset", "2026-11-30T12:00:20Z"),
        ("anthropic-ratelimit-tokens-remaining", "0"),
    ];
    assert_eq!(pushback_of(&anthropic, 429).0, after(secs(20)));
    // Resets are pushback on 429/503 only, unless their counter is 0.
    assert_eq!(pushback_of(&[("x-ratelimit-reset-requests", "6m0s")], 500).0, None);
    assert_eq!(pushback_of(&[("ratelimit-reset", "30")], 500).0, None);
}

#[test]
fn an_exhausted_counter_makes_a_reset_pushback_on_any_status() {
    // GitHub: 403 with the primary limit exhausted.
    let github = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1796040090")];
    assert_eq!(pushback_of(&github, 403).0, after(secs(90)));
    // A secondary limit (remaining > 0): the hourly reset is not the window to wait for.
    let secondary = [("x-ratelimit-remaining", "4000"), ("x-ratelimit-reset", "1796043600")];
    assert_eq!(pushback_of(&secondary, 403).0, None);
    assert_eq!(pushback_of(&secondary, 429).0, None);
    // IETF draft headers, delta seconds.
    assert_eq!(
        pushback_of(&[("ratelimit-remaining", "0"), ("ratelimit-reset", "30")], 200).0,
        after(secs(30))
    );
    // An unreadable counter is as good as none.
    let unreadable = [("x-ratelimit-remaining", "lots"), ("x-ratelimit-reset", "30")];
    assert_eq!(pushback_of(&unreadable, 403).0, None);
    assert_eq!(pushback_of(&unreadable, 429).0, after(secs(30)));
}

#[test]
fn malformed_and_implausible_resets_are_ignored_and_counted() {
    for (name, value) in [
        ("x-ratelimit-reset", "-5"),
        ("x-ratelimit-reset", "1796040000000"), // milliseconds
        ("x-ratelimit-reset", "999999999"),     // 31 years
        ("ratelimit-reset", "soon"),
        ("anthropic-ratelimit-requests-reset", "2026-13-01T00:00:00Z"),
        ("anthropic-ratelimit-requests-reset", "9999-12-31T23:59:59Z"),
        ("x-ratelimit-reset-tokens", "6min"),
        ("x-ratelimit-reset-tokens", "60"),
        ("x-ratelimit-reset-tokens", "-1s"),
    ] {
        let (p, stats) = pushback_of(&[(name, value)], 429);
        assert_eq!(p, None, "{name}: {value}");
        assert_eq!(stats.get(HeaderKind::Reset), 1, "{name}: {value}");
        assert_eq!(stats.total(), 1);
    }
}

#[test]
fn configured_names_and_formats() {
    let config = PushbackHeadersConfig {
        statuses: vec![429, 502],
        retry_after: vec!["X-Wait".to_string()],
        retry_after_ms: vec![],
        grpc_retry_pushback_ms: vec![],
        should_retry: vec![],
        resets: vec![
            ResetHeader::new("x-rate-limit-reset", ResetFormat::HttpDate),
            ResetHeader::new("X-Acme-*-Reset", ResetFormat::UnixMillis),
            ResetHeader::new("x-acme-*", ResetFormat::DeltaSeconds),
        ],
        max_plausible: secs(3_600),
    };
    let headers = PushbackHeaders::try_new(config).unwrap();
    let stats = HeaderStats::new();
    let now = at(NOV_30);
    let read = |pairs: &[(&str, &str)], status| {
        headers.read_pushback(&map(pairs), StatusCode::from_u16(status).unwrap(), now, &stats)
    };
    assert_eq!(read(&[("x-wait", "7")], 502), after(secs(7)));
    assert_eq!(read(&[("x-wait", "7")], 503), None);
    assert_eq!(read(&[("retry-after", "7")], 429), None);
    assert_eq!(read(&[("grpc-retry-pushback-ms", "-1")], 429), None);
    assert_eq!(
        read(&[("x-rate-limit-reset", "Mon, 30 Nov 2026 12:00:05 GMT")], 429),
        after(secs(5))
    );
    // The first matching rule decides the format.
    assert_eq!(read(&[("x-acme-quota-reset", "1796040000250")], 429), after(ms(250)));
    assert_eq!(read(&[("x-acme-other", "9")], 429), after(secs(9)));
    // max_plausible of an hour.
    assert_eq!(read(&[("x-wait", "3601")], 429), None);
    assert_eq!(stats.get(HeaderKind::RetryAfter), 1);
    assert_eq!(headers.config().max_plausible, secs(3_600));
}

#[test]
fn refuses_bad_configs() {
    let with = |f: &dyn Fn(&mut PushbackHeadersConfig)| {
        let mut c = PushbackHeadersConfig::default();
        f(&mut c);
        PushbackHeaders::try_new(c).map(|_| ())
    };
    assert_eq!(with(&|_| {}), Ok(()));
    assert_eq!(with(&|c| c.statuses = vec![42]), Err(HeaderConfigError::BadStatus(42)));
    assert_eq!(
        with(&|c| c.retry_after = vec!["bad name".to_string()]),
        Err(HeaderConfigError::BadName("bad name".to_string()))
    );
    for pattern in ["*", "a-*-*", "a b-*", "x-*-\u{e9}"] {
        assert_eq!(
            with(&|c| c.resets = vec![ResetHeader::new(pattern, ResetFormat::UnixSeconds)]),
            Err(HeaderConfigError::BadPattern(pattern.to_string())),
            "{pattern}"
        );
    }
    for max in [Duration::ZERO, ms(999), LONGEST_MAX_PLAUSIBLE + secs(1)] {
        assert_eq!(with(&|c| c.max_plausible = max), Err(HeaderConfigError::MaxPlausible(max)));
    }
    assert_eq!(with(&|c| c.max_plausible = LONGEST_MAX_PLAUSIBLE), Ok(()));
    let mut limits = LimitHeadersConfig::default();
    limits.remaining.push(String::new());
    assert_eq!(
        LimitHeaders::try_new(limits).unwrap_err(),
        HeaderConfigError::BadName(String::new())
    );
    assert_eq!(
        HeaderConfigError::MaxPlausible(Duration::ZERO).to_string(),
        "max_plausible must be from 1s to 100 years, got 0ns"
    );
}

#[test]
fn stricter_orders_dont_retry_then_longest() {
    use Pushback::{DontRetry, RetryAfter};
    let (a, b) = (Some(RetryAfter(secs(1))), Some(RetryAfter(secs(2))));
    assert_eq!(stricter(a, b), b);
    assert_eq!(stricter(b, a), b);
    assert_eq!(stricter(a, None), a);
    assert_eq!(stricter(None, a), a);
    assert_eq!(stricter(None, None), None);
    assert_eq!(stricter(a, Some(DontRetry)), Some(DontRetry));
    assert_eq!(stricter(Some(DontRetry), None), Some(DontRetry));
}

fn limits_of(pairs: &[(&str, &str)]) -> (LimitInfo, HeaderStatsSnapshot) {
    let stats = HeaderStats::new();
    let info = LimitHeaders::default().read_limits(&map(pairs), at(NOV_30), &stats);
    (info, stats.snapshot())
}

#[test]
fn limits_take_the_most_conservative_value() {
    assert_eq!(limits_of(&[]).0, LimitInfo::default());
    assert!(limits_of(&[]).0.is_empty());
    let (info, stats) = limits_of(&[
        ("x-concurrency-limit-limit", "12"),
        ("x-concurrency-limit-limit", "9"),
        ("x-concurrency-limit-remaining", "4"),
        ("ratelimit-remaining", "7"),
        ("x-ratelimit-remaining", "2"),
        ("ratelimit-reset", "30"),
        ("x-ratelimit-reset", "1796040060"),
    ]);
    assert_eq!(info, LimitInfo { limit: Some(9), remaining: Some(2), reset: Some(secs(60)) });
    assert!(!info.is_empty());
    assert_eq!(stats.total(), 0);
    assert_eq!(limits_of(&[("x-concurrency-limit-limit", "0")]).0.limit, Some(0));
    assert_eq!(limits_of(&[("x-ratelimit-reset", "1796030000")]).0.reset, Some(Duration::ZERO));
}

#[test]
fn malformed_limits_are_ignored_and_counted() {
    let (info, stats) = limits_of(&[
        ("x-concurrency-limit-limit", "-3"),
        ("x-concurrency-limit-limit", "lots"),
        ("x-concurrency-limit-limit", "8"),
        ("x-concurrency-limit-remaining", "1.5"),
        ("ratelimit-remaining", "99999999999999999999999"),
        ("x-ratelimit-reset", "1796040000000"),
        ("ratelimit-reset", ""),
    ]);
    assert_eq!(info, LimitInfo { limit: Some(8), remaining: None, reset: None });
    assert_eq!(stats.get(HeaderKind::Limit), 2);
    assert_eq!(stats.get(HeaderKind::Remaining), 2);
    assert_eq!(stats.get(HeaderKind::Reset), 2);
    assert_eq!(stats.total(), 6);
}

#[test]
fn non_utf8_header_values_are_counted_not_fatal() {
    let mut headers = HeaderMap::new();
    for name in ["retry-after", "retry-after-ms", "x-ratelimit-reset-tokens"] {
        headers.insert(name, HeaderValue::from_bytes(b"\xfa\xfb").unwrap());
    }
    headers.insert("x-concurrency-limit-limit", HeaderValue::from_bytes(b"\xff").unwrap());
    let stats = HeaderStats::new();
    let status = StatusCode::TOO_MANY_REQUESTS;
    assert_eq!(
        PushbackHeaders::default().read_pushback(&headers, status, at(NOV_30), &stats),
        None
    );
    assert!(LimitHeaders::default().read_limits(&headers, at(NOV_30), &stats).is_empty());
    let snapshot = stats.snapshot();
    assert_eq!(snapshot.total(), 4);
    for kind in HeaderKind::ALL {
        assert_eq!(snapshot.get(kind), stats.get(kind), "{kind}");
    }
}

// ---- formatters for the round trips (test-only) -------------------------------------------

/// As Go's `time.Duration.String()` prints it.
fn go_format(d: Duration) -> String {
    let n = u64::try_from(d.as_nanos()).unwrap();
    let fraction = |rest: u64, scale: u64| {
        let digits = scale.ilog10() as usize;
        let text = format!("{rest:0digits$}");
        let text = text.trim_end_matches('0');
        if text.is_empty() { String::new() } else { format!(".{text}") }
    };
    if n == 0 {
        return "0s".to_string();
    }
    if n < NANOS_PER_SEC {
        let (unit, scale) = if n < 1_000 {
            ("ns", 1)
        } else if n < 1_000_000 {
            ("µs", 1_000)
        } else {
            ("ms", 1_000_000)
        };
        let frac = if scale == 1 { String::new() } else { fraction(n % scale, scale) };
        return format!("{}{frac}{unit}", n / scale);
    }
    let frac = fraction(n % NANOS_PER_SEC, NANOS_PER_SEC);
    let s = n / NANOS_PER_SEC;
    match (s / 3_600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}{frac}s"),
        (0, min, sec) => format!("{min}m{sec}{frac}s"),
        (h, min, sec) => format!("{h}h{min}m{sec}{frac}s"),
    }
}

#[test]
fn go_format_matches_go() {
    for (d, go) in [
        (secs(360), "6m0s"),
        (secs(3_600), "1h0m0s"),
        (ms(1_500), "1.5s"),
        (ms(250), "250ms"),
        (Duration::from_nanos(1_500), "1.5µs"),
        (Duration::from_nanos(3_723_500_000_000), "1h2m3.5s"),
        (Duration::from_nanos(u64::MAX), "5124095h34m33.709551615s"),
        (Duration::ZERO, "0s"),
    ] {
        assert_eq!(go_format(d), go);
    }
}

/// Howard Hinnant's `civil_from_days`: the proleptic Gregorian date of a day counted from
/// 1970-01-01 (an independent check on the library's calendar).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// RFC 3339 text for `unix_secs` + `nanos`, written at an offset of `offset_min` minutes.
fn rfc3339_format(unix_secs: i64, nanos: u32, offset_min: i64) -> String {
    let local = unix_secs + offset_min * 60;
    let (y, mo, d) = civil_from_days(local.div_euclid(86_400));
    let s = local.rem_euclid(86_400);
    let frac = if nanos == 0 { String::new() } else { format!(".{nanos:09}") };
    let offset = match offset_min {
        0 => "Z".to_string(),
        m => {
            format!("{}{:02}:{:02}", if m < 0 { '-' } else { '+' }, m.abs() / 60, m.abs() % 60)
        }
    };
    format!("{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}{frac}{offset}", s / 3_600, s / 60 % 60, s % 60)
}

#[test]
fn rfc3339_format_anchors() {
    assert_eq!(rfc3339_format(0, 0, 0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339_format(NOV_30 as i64, 0, 60), "2026-11-30T13:00:00+01:00");
    assert_eq!(rfc3339_format(-62_135_596_800, 5, -90), "0000-12-31T22:30:00.000000005-01:30");
    assert_eq!(civil_from_days(19_782), (2024, 2, 29));
}

/// The three HTTP-date forms of one instant (1970–9999).
fn http_date_forms(unix_secs: u64) -> [String; 3] {
    const DAYS: [&str; 7] =
        ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    const MONTHS: [&str; 12] =
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let days = (unix_secs / 86_400) as i64;
    let (y, m, d) = civil_from_days(days);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let s = unix_secs % 86_400;
    let time = format!("{:02}:{:02}:{:02}", s / 3_600, s / 60 % 60, s % 60);
    [
        format!("{}, {d:02} {month} {y:04} {time} GMT", &weekday[..3]),
        format!("{weekday}, {d:02}-{month}-{:02} {time} GMT", y % 100),
        format!("{} {month} {d:>2} {time} {y:04}", &weekday[..3]),
    ]
}

#[test]
fn http_date_forms_anchor() {
    assert_eq!(
        http_date_forms(784_111_777),
        [
            "Sun, 06 Nov 1994 08:49:37 GMT".to_string(),
            "Sunday, 06-Nov-94 08:49:37 GMT".to_string(),
            "Sun Nov  6 08:49:37 1994".to_string(),
        ]
    );
    assert_eq!(http_date_forms(0)[0], httpdate::fmt_http_date(UNIX_EPOCH));
}

/// Byte strings that look like header values: mostly the characters the parsers care about.
fn near_valid() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..48),
        "[0-9 .:+\\-TZtzsmhnuµμ,]{0,32}".prop_map(String::into_bytes),
        "[0-9]{1,30}(\\.[0-9]{0,25})?".prop_map(String::into_bytes),
        "[-+]?([0-9]{0,3}(\\.[0-9]{0,3})?(ns|us|µs|ms|s|m|h|x)?){0,4}".prop_map(String::into_bytes),
        "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,12})?(Z|[+-][0-9]{2}:[0-9]{2})?"
            .prop_map(String::into_bytes),
        "(Sun|Mon|Sunday), [0-9 ]{2}[ -](Nov|Feb)[ -][0-9]{2,4} [0-9]{2}:[0-9]{2}:[0-9]{2}( GMT)?"
            .prop_map(String::into_bytes),
    ]
}

fn any_wall_clock() -> impl Strategy<Value = SystemTime> {
    (any::<bool>(), 0u64..=1 << 40, 0u32..1_000_000_000).prop_map(|(before, s, n)| {
        let d = Duration::new(s, n);
        if before { UNIX_EPOCH - d } else { UNIX_EPOCH + d }
    })
}

fn any_format() -> impl Strategy<Value = ResetFormat> {
    proptest::sample::select(ResetFormat::ALL.to_vec())
}

proptest! {
    #[test]
    fn no_bytes_make_a_parser_panic(
        value in near_valid(),
        now in any_wall_clock(),
        max_nanos: u64,
        format in any_format(),
    ) {
        let max = Duration::from_nanos(max_nanos);
        if let Ok(d) = parse_retry_after(&value, now, max) { prop_assert!(d <= max); }
        if let Ok(d) = parse_retry_after_ms(&value, max) { prop_assert!(d <= max); }
        if let Ok(d) = parse_reset(&value, format, now, max) { prop_assert!(d <= max); }
        let _ = parse_grpc_pushback(&value);
        let _ = parse_count(&value);
        let _ = parse_go_duration(&value);
        let _ = parse_rfc3339(&value);
    }

    #[test]
    fn no_header_map_makes_a_reader_panic(
        pairs in proptest::collection::vec(
            (
                proptest::sample::select(vec![
                    "retry-after", "retry-after-ms", "x-ms-retry-after-ms",
                    "grpc-retry-pushback-ms", "x-ratelimit-reset", "ratelimit-reset",
                    "x-ratelimit-remaining", "ratelimit-remaining",
                    "anthropic-ratelimit-requests-reset",
                    "anthropic-ratelimit-requests-remaining",
                    "x-ratelimit-reset-tokens", "x-ratelimit-remaining-tokens",
                    "x-concurrency-limit-limit", "x-concurrency-limit-remaining",
                ]),
                near_valid(),
            ),
            0..8,
        ),
        status in 100u16..600,
        now in any_wall_clock(),
    ) {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            if let Ok(value) = HeaderValue::from_bytes(&value) {
                headers.append(name, value);
            }
        }
        let stats = HeaderStats::new();
        let status = StatusCode::from_u16(status).unwrap();
        let pushback = PushbackHeaders::default().read_pushback(&headers, status, now, &stats);
        // gRPC pushback has no max_plausible (core's max_pushback refuses a long one).
        if let Some(Pushback::RetryAfter(d)) = pushback
            && !headers.contains_key("grpc-retry-pushback-ms")
        {
            prop_assert!(d <= DEFAULT_MAX_PLAUSIBLE);
        }
        let info = LimitHeaders::default().read_limits(&headers, now, &stats);
        prop_assert!(info.reset.is_none_or(|d| d <= DEFAULT_MAX_PLAUSIBLE));
    }

    #[test]
    fn delta_seconds_and_millis_round_trip(s in 0u64..=31_622_400, m in 0u64..=31_622_400_000) {
        let now = at(NOV_30);
        prop_assert_eq!(parse_retry_after(s.to_string().as_bytes(), now, YEAR), Ok(secs(s)));
        prop_assert_eq!(
            parse_reset(s.to_string().as_bytes(), ResetFormat::DeltaSeconds, now, YEAR),
            Ok(secs(s))
        );
        prop_assert_eq!(parse_retry_after_ms(m.to_string().as_bytes(), YEAR), Ok(ms(m)));
        prop_assert_eq!(
            parse_grpc_pushback(m.to_string().as_bytes()),
            Ok(Pushback::RetryAfter(ms(m)))
        );
        prop_assert_eq!(parse_count(m.to_string().as_bytes()), Ok(m));
        if m > 0 {
            prop_assert_eq!(
                parse_grpc_pushback(format!("-{m}").as_bytes()),
                Ok(Pushback::DontRetry)
            );
        }
    }

    #[test]
    fn go_durations_round_trip(nanos in 0u64..=u64::MAX, small in 0u64..=3_600_000_000_000) {
        for n in [nanos, small] {
            let d = Duration::from_nanos(n);
            let text = go_format(d);
            prop_assert_eq!(parse_go_duration(text.as_bytes()), Ok(d), "{}", text);
        }
    }

    #[test]
    fn rfc3339_round_trips(
        // 0000-01-01T00:00:00Z ..= 9999-12-31T23:59:59Z, kept inside 0000–9999 locally.
        unix_secs in -62_167_219_200i64 + 86_400..=253_402_300_799 - 86_400,
        nanos in 0u32..1_000_000_000,
        offset_min in -(23 * 60 + 59)..=23i64 * 60 + 59,
        now_secs in 0u64..=4_102_444_800,
    ) {
        let text = rfc3339_format(unix_secs, nanos, offset_min);
        let want = i128::from(unix_secs) * 1_000_000_000 + i128::from(nanos);
        prop_assert_eq!(rfc3339_unix_nanos(text.as_bytes()), Ok(want), "{}", &text);
        let now = at(now_secs);
        let wait = want - i128::from(now_secs) * 1_000_000_000;
        let got = parse_reset(text.as_bytes(), ResetFormat::Rfc3339, now, YEAR);
        if wait <= 0 {
            prop_assert_eq!(got, Ok(Duration::ZERO));
        } else if wait <= YEAR.as_nanos() as i128 {
            prop_assert_eq!(got, Ok(nanos_to_duration(wait as u128)));
        } else {
            prop_assert_eq!(got, Err(Malformed::TooFar));
        }
    }

    #[test]
    fn http_dates_round_trip_in_every_form(
        now_secs in 0u64..=253_402_300_799 - 31_622_400,
        ahead in 0u64..=31_622_400,
        behind in 0u64..=1_000_000,
    ) {
        let now = at(now_secs);
        let target = now_secs + ahead;
        let [imf, rfc850, asctime] = http_date_forms(target);
        prop_assert_eq!(&imf, &httpdate::fmt_http_date(at(target)));
        prop_assert_eq!(parse_retry_after(imf.as_bytes(), now, YEAR), Ok(secs(ahead)));
        prop_assert_eq!(parse_retry_after(asctime.as_bytes(), now, YEAR), Ok(secs(ahead)));
        // RFC 850 has a two-digit year, which httpdate reads as 1970–2069.
        let (year, ..) = civil_from_days((target / 86_400) as i64);
        if (1970..2070).contains(&year) {
            prop_assert_eq!(parse_retry_after(rfc850.as_bytes(), now, YEAR), Ok(secs(ahead)));
        }
        // A date in the past is a zero wait.
        let past = httpdate::fmt_http_date(at(now_secs.saturating_sub(behind)));
        prop_assert_eq!(parse_retry_after(past.as_bytes(), now, YEAR), Ok(Duration::ZERO));
    }

    #[test]
    fn unix_resets_round_trip(
        now_secs in UNIX_THRESHOLD..=4_102_444_800,
        ahead in 0u64..=31_622_400,
        millis in 0u64..1_000,
    ) {
        let now = at(now_secs);
        let target = now_secs + ahead;
        for format in [ResetFormat::UnixOrDelta, ResetFormat::UnixSeconds] {
            prop_assert_eq!(
                parse_reset(target.to_string().as_bytes(), format, now, YEAR),
                Ok(secs(ahead))
            );
        }
        let target_ms = format!("{target}{millis:03}");
        prop_assert_eq!(
            parse_reset(target_ms.as_bytes(), ResetFormat::UnixMillis, now, YEAR),
            Ok(secs(ahead) + ms(millis))
        );
        // Below 10^9, the same format reads a wait from now.
        let delta = ahead.min(UNIX_THRESHOLD - 1);
        prop_assert_eq!(
            parse_reset(delta.to_string().as_bytes(), ResetFormat::UnixOrDelta, now, YEAR),
            Ok(secs(delta))
        );
    }
}

/// A message with fewer names than the list is read name by name, a longer one by looking each
/// of the list's names up: both find a limit header wherever it is, and only a limit or a
/// remaining header counts (a reset alone does not).
#[test]
fn mentions_limits_either_way_round() {
    let l = LimitHeaders::default();
    assert!(!l.mentions_limits(&HeaderMap::new()));
    assert!(l.mentions_limits(&map(&[("X-RateLimit-Remaining", "3")])));
    assert!(l.mentions_limits(&map(&[("content-type", "x"), ("x-concurrency-limit-limit", "9")])));
    assert!(!l.mentions_limits(&map(&[("content-type", "x"), ("x-ratelimit-reset", "9")])));
    let many: Vec<(String, &str)> = (0..10).map(|i| (format!("x-other-{i}"), "1")).collect();
    let mut pairs: Vec<(&str, &str)> = many.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    assert!(!l.mentions_limits(&map(&pairs)));
    pairs.push(("ratelimit-remaining", "0"));
    assert!(l.mentions_limits(&map(&pairs)));
}
