//! Just enough of a certificate's DER for what libpq looks at beyond webpki's checks: the hash of
//! its signature (channel binding), its validity dates (a certificate trusted as itself), and its
//! subjectAltName kinds and first Common Name (libpq's fallback to the CN). Reads only; every
//! function answers `None` for what it cannot parse, and the caller refuses or goes without.

/// A hash of the SHA-2 family, as `tls-server-end-point` uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hash {
    Sha224,
    Sha256,
    Sha384,
    Sha512,
}

/// The next DER element of `input` (low tag numbers only, which is all a certificate uses): its
/// tag, its contents and what follows it.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let (bytes, rest) = rest.split_at(n);
        let len = bytes
            .iter()
            .fold(0usize, |len, b| (len << 8) | usize::from(*b));
        (len, rest)
    };
    if rest.len() < len {
        return None;
    }
    let (contents, rest) = rest.split_at(len);
    Some((tag, contents, rest))
}

/// The element at the start of `input` when its tag is `tag`: its contents and what follows.
fn expect(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    match element(input)? {
        (found, contents, rest) if found == tag => Some((contents, rest)),
        _ => None,
    }
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;

/// The fields of a certificate this module reads.
struct Fields<'a> {
    /// The contents of the outer `signatureAlgorithm` (an AlgorithmIdentifier).
    signature_algorithm: &'a [u8],
    /// The contents of `validity`.
    validity: &'a [u8],
    /// The contents of `subject` (a Name).
    subject: &'a [u8],
    /// The contents of the extensions' SEQUENCE, when there are any.
    extensions: Option<&'a [u8]>,
}

fn fields(cert: &[u8]) -> Option<Fields<'_>> {
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signatureValue }
    let (certificate, _) = expect(cert, SEQUENCE)?;
    let (tbs, rest) = expect(certificate, SEQUENCE)?;
    let (signature_algorithm, _) = expect(rest, SEQUENCE)?;
    // TBSCertificate ::= SEQUENCE { [0] version OPTIONAL, serialNumber, signature, issuer,
    //   validity, subject, subjectPublicKeyInfo, [1] [2] unique ids OPTIONAL, [3] extensions }
    let mut rest = tbs;
    if rest.first() == Some(&0xa0) {
        rest = element(rest)?.2;
    }
    let (_serial, rest) = expect(rest, 0x02)?;
    let (_signature, rest) = expect(rest, SEQUENCE)?;
    let (_issuer, rest) = expect(rest, SEQUENCE)?;
    let (validity, rest) = expect(rest, SEQUENCE)?;
    let (subject, rest) = expect(rest, SEQUENCE)?;
    let (_key, mut rest) = expect(rest, SEQUENCE)?;
    let mut extensions = None;
    while !rest.is_empty() {
        let (tag, contents, next) = element(rest)?;
        if tag == 0xa3 {
            extensions = Some(expect(contents, SEQUENCE)?.0);
        }
        rest = next;
    }
    Some(Fields {
        signature_algorithm,
        validity,
        subject,
        extensions,
    })
}

/// The hash `tls-server-end-point` (RFC 5929 §4.1) uses for `cert`: the hash of its signature
/// algorithm, SHA-256 in place of MD5 and SHA-1. RSA-PSS names its hash in its parameters
/// (SHA-1 when absent). `None` for algorithms without a hash of their own (Ed25519, Ed448), for
/// those the SHA-2 family does not cover, and for what cannot be parsed: SCRAM then runs without
/// channel binding.
pub(crate) fn signature_hash(cert: &[u8]) -> Option<Hash> {
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01]; // 1.2.840.113549.1.1
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03]; // 1.2.840.10045.4.3
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01]; // 1.2.840.10045.4.1
    let algorithm = fields(cert)?.signature_algorithm;
    let (oid, parameters) = expect(algorithm, OID)?;
    if oid == ECDSA_SHA1 {
        return Some(Hash::Sha256);
    }
    let (&last, head) = oid.split_last()?;
    if head == RSA {
        return match last {
            0x04 | 0x05 | 0x0b => Some(Hash::Sha256), // MD5, SHA-1, SHA-256 with RSA
            0x0c => Some(Hash::Sha384),
            0x0d => Some(Hash::Sha512),
            0x0e => Some(Hash::Sha224),
            0x0a => pss_hash(parameters), // RSASSA-PSS
            _ => None,
        };
    }
    if head == ECDSA_SHA2 {
        return match last {
            0x01 => Some(Hash::Sha224),
            0x02 => Some(Hash::Sha256),
            0x03 => Some(Hash::Sha384),
            0x04 => Some(Hash::Sha512),
            _ => None,
        };
    }
    None
}

/// The hash of RSASSA-PSS-params (RFC 4055): `SEQUENCE { hashAlgorithm [0] DEFAULT sha1, ... }`.
fn pss_hash(parameters: &[u8]) -> Option<Hash> {
    const SHA1: &[u8] = &[0x2b, 0x0e, 0x03, 0x02, 0x1a]; // 1.3.14.3.2.26
    const SHA2: &[u8] = &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02]; // 2.16.840.1.101.3.4.2
    // Parameters are mandatory for PSS: without them the signature's hash is not known.
    let (params, _) = expect(parameters, SEQUENCE)?;
    let Some((hash_algorithm, _)) = expect(params, 0xa0) else {
        return Some(Hash::Sha256); // hashAlgorithm absent: SHA-1, which binds with SHA-256
    };
    let (identifier, _) = expect(hash_algorithm, SEQUENCE)?;
    let (oid, _) = expect(identifier, OID)?;
    if oid == SHA1 {
        return Some(Hash::Sha256);
    }
    match oid.split_last()? {
        (0x01, head) if head == SHA2 => Some(Hash::Sha256),
        (0x02, head) if head == SHA2 => Some(Hash::Sha384),
        (0x03, head) if head == SHA2 => Some(Hash::Sha512),
        (0x04, head) if head == SHA2 => Some(Hash::Sha224),
        _ => None,
    }
}

/// `notBefore` and `notAfter`, in seconds since the Unix epoch.
pub(crate) fn validity(cert: &[u8]) -> Option<(i64, i64)> {
    let validity = fields(cert)?.validity;
    let (tag, not_before, rest) = element(validity)?;
    let not_before = time(tag, not_before)?;
    let (tag, not_after, _) = element(rest)?;
    Some((not_before, time(tag, not_after)?))
}

/// A DER UTCTime (`YYMMDDHHMMSSZ`, years 1950 to 2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`).
fn time(tag: u8, text: &[u8]) -> Option<i64> {
    let digits = |range: std::ops::Range<usize>| -> Option<i64> {
        let bytes = text.get(range)?;
        bytes.iter().try_fold(0i64, |n, b| {
            b.is_ascii_digit().then(|| n * 10 + i64::from(b - b'0'))
        })
    };
    let (year, rest) = match (tag, text.len()) {
        (0x17, 13) => {
            let yy = digits(0..2)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, 2)
        }
        (0x18, 15) => (digits(0..4)?, 4),
        _ => return None,
    };
    if text.last() != Some(&b'Z') {
        return None;
    }
    let month = digits(rest..rest + 2)?;
    let day = digits(rest + 2..rest + 4)?;
    let hour = digits(rest + 4..rest + 6)?;
    let minute = digits(rest + 6..rest + 8)?;
    let second = digits(rest + 8..rest + 10)?;
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second)
}

/// Days from 1970-01-01 to the given date of the proleptic Gregorian calendar (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// Which kinds of names the certificate's subjectAltName holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AltNames {
    pub dns: bool,
    pub ip: bool,
}

/// The kinds of names of the subjectAltName extension (none without one); `None` when the
/// certificate cannot be parsed.
pub(crate) fn alt_names(cert: &[u8]) -> Option<AltNames> {
    const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11]; // 2.5.29.17
    let mut found = AltNames::default();
    let Some(mut extensions) = fields(cert)?.extensions else {
        return Some(found);
    };
    while !extensions.is_empty() {
        let (extension, next) = expect(extensions, SEQUENCE)?;
        extensions = next;
        let (oid, rest) = expect(extension, OID)?;
        if oid != SUBJECT_ALT_NAME {
            continue;
        }
        // critical BOOLEAN DEFAULT FALSE, then extnValue OCTET STRING.
        let rest = match expect(rest, 0x01) {
            Some((_, rest)) => rest,
            None => rest,
        };
        let (value, _) = expect(rest, 0x04)?;
        let (mut names, _) = expect(value, SEQUENCE)?;
        while !names.is_empty() {
            let (tag, _, next) = element(names)?;
            names = next;
            match tag {
                0x82 => found.dns = true, // [2] dNSName
                0x87 => found.ip = true,  // [7] iPAddress
                _ => {}
            }
        }
    }
    Some(found)
}

/// The subject's first Common Name (the one libpq reads), when it is text.
pub(crate) fn common_name(cert: &[u8]) -> Option<&str> {
    const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03]; // 2.5.4.3
    let mut rdns = fields(cert)?.subject;
    while !rdns.is_empty() {
        let (mut rdn, next) = expect(rdns, SET)?;
        rdns = next;
        while !rdn.is_empty() {
            let (attribute, next) = expect(rdn, SEQUENCE)?;
            rdn = next;
            let (oid, value) = expect(attribute, OID)?;
            if oid != COMMON_NAME {
                continue;
            }
            let (tag, text, _) = element(value)?;
            // UTF8String, PrintableString, T61String, IA5String.
            if !matches!(tag, 0x0c | 0x13 | 0x14 | 0x16) {
                return None;
            }
            return std::str::from_utf8(text).ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_of_both_encodings() {
        assert_eq!(time(0x17, b"700101000000Z"), Some(0));
        assert_eq!(time(0x17, b"491231235959Z"), Some(2_524_607_999));
        assert_eq!(time(0x18, b"20000229120000Z"), Some(951_825_600));
        assert_eq!(time(0x18, b"19691231235959Z"), Some(-1));
        assert_eq!(time(0x17, b"700101000000"), None, "no Z");
        assert_eq!(time(0x17, b"701301000000Z"), None, "month 13");
        assert_eq!(time(0x18, b"700101000000Z"), None, "wrong length");
        assert_eq!(time(0x17, b"7001010000+0Z"), None);
    }

    #[test]
    fn names_and_dates_of_rcgen_certificates() {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["db.internal".to_owned()]).expect("params");
        params.subject_alt_names.push(rcgen::SanType::IpAddress(
            std::net::Ipv4Addr::LOCALHOST.into(),
        ));
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "sbp");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "cn.internal");
        params.not_before = rcgen::date_time_ymd(2001, 2, 3);
        params.not_after = rcgen::date_time_ymd(2060, 1, 1);
        let cert = params.self_signed(&key).expect("cert");
        let der = cert.der();
        assert_eq!(
            alt_names(der),
            Some(AltNames {
                dns: true,
                ip: true
            })
        );
        assert_eq!(common_name(der), Some("cn.internal"));
        assert_eq!(validity(der), Some((981_158_400, 2_840_140_800)));

        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "only.cn");
        let cert = params.self_signed(&key).expect("cert");
        assert_eq!(alt_names(cert.der()), Some(AltNames::default()));
        assert_eq!(common_name(cert.der()), Some("only.cn"));

        assert_eq!(alt_names(&der[..der.len() / 2]), None, "cut short");
        assert_eq!(common_name(b""), None);
    }
}
