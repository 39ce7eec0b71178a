/* The common OpenAI streamed response, scanned without a Python object per event.
 *
 * `sse_scan` takes one whole stream (every socket read joined) with the length and time of
 * each read, and fills per-event arrays: the time of the read that brought the event's closing
 * blank line, its text's code points and UTF-8 bytes (the text decoded into `text`), an id per
 * distinct text, the usage so far it carries and the length of its `token_ids`. It accepts only
 * what `harness.sse.parse_stream` would accept without an error and reads it the same way;
 * anything else (another SSE field, a comment, \r, invalid JSON or UTF-8, an `error` event, a
 * field of an unexpected type, a number that does not fit, a delta's `reasoning_content`,
 * `reasoning` or `tool_calls` that is not null) returns FALLBACK and the Python parser decides.
 * The JSON grammar is RFC 8259's, checked in full for every event (an event that repeats the
 * one before it but for its text string is checked as that one was: `repeat_event`).
 *
 * Built by `harness.sse_native` with the C compiler when there is one; plain C99, no Python
 * headers, loaded with ctypes. */
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define FALLBACK (-1)
#define MAX_DEPTH 64
#define NONE_I64 INT64_MIN

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
    int depth;
} Cur;

typedef struct { /* one event's findings */
    int has_text;
    int64_t text_bytes;
    int64_t text_chars;
    int64_t usage_completion; /* NONE_I64: none */
    int64_t n_ids;            /* -1: no token_ids list */
    const uint8_t *id_start, *id_end;         /* a string id (raw, quotes included) */
    const uint8_t *finish_start, *finish_end; /* a non-empty finish_reason string */
    const uint8_t *usage_start, *usage_end;   /* a non-empty usage object */
    const uint8_t *text_at, *text_end; /* the string the text came from (quotes included) */
} Event;

/* No text (yet): a null text, a delta or `choices` that replaces an earlier one's. */
static inline void forget_text(Event *e) {
    e->has_text = 0;
    e->text_bytes = e->text_chars = 0;
    e->text_at = e->text_end = NULL;
}

static inline void skip_ws(Cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t')) c->p++;
}

/* The first byte at or after p that a string cannot copy as it is: a quote, a backslash, a
 * control character or a byte of a multi-byte UTF-8 sequence (or `end`). */
static inline const uint8_t *plain_run(const uint8_t *p, const uint8_t *end) {
#ifdef __SSE2__
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\');
    const __m128i space = _mm_set1_epi8(0x20);
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        /* signed: bytes of 0x80 and above are negative, so one compare finds them too */
        __m128i special = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote),
                                                    _mm_cmpeq_epi8(v, backslash)),
                                       _mm_cmplt_epi8(v, space));
        int mask = _mm_movemask_epi8(special);
        if (mask) return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    while (p < end && *p >= 0x20 && *p < 0x80 && *p != '"' && *p != '\\') p++;
    return p;
}

static int hex4(const uint8_t *p, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t ch = p[i];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (uint32_t)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (uint32_t)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') v |= (uint32_t)(ch - 'A' + 10);
        else return FALLBACK;
    }
    *out = v;
    return 0;
}

static inline int put_utf8(uint8_t *out, uint32_t cp) {
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6)); out[1] = (uint8_t)(0x80 | (cp & 0x3F)); return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12)); out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F)); return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18)); out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* The length of the valid UTF-8 sequence at p (Unicode's Table 3-7), 0 if invalid. */
static inline int utf8_len(const uint8_t *p, const uint8_t *end) {
    uint8_t b = p[0];
    int n;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) n = 2;
    else if (b >= 0xE0 && b <= 0xEF) {
        n = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        n = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else return 0;
    if (end - p < n) return 0;
    if (p[1] < lo || p[1] > hi) return 0;
    for (int i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xBF) return 0;
    return n;
}

/* A JSON string at c->p (its opening quote). When `out` is given, the decoded UTF-8 goes
 * there; `n_bytes` and `n_chars` get its decoded length in bytes and code points. */
static int parse_string(Cur *c, uint8_t *out, int64_t *n_bytes, int64_t *n_chars) {
    const uint8_t *p = c->p + 1, *end = c->end;
    int64_t bytes = 0, chars = 0;
    for (;;) {
        const uint8_t *run = p;
        p = plain_run(p, end);
        if (p > run) {
            if (out) memcpy(out + bytes, run, (size_t)(p - run));
            bytes += p - run;
            chars += p - run;
        }
        if (p >= end) return FALLBACK;
        uint8_t ch = *p;
        if (ch == '"') { p++; break; }
        if (ch < 0x20) return FALLBACK; /* a raw control character */
        if (ch >= 0x80) {
            int n = utf8_len(p, end);
            if (!n) return FALLBACK;
            if (out) memcpy(out + bytes, p, (size_t)n);
            bytes += n;
            chars += 1;
            p += n;
            continue;
        }
        /* a backslash */
        if (end - p < 2) return FALLBACK;
        uint8_t esc = p[1];
        uint32_t cp;
        p += 2;
        switch (esc) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u':
                if (end - p < 4 || hex4(p, &cp)) return FALLBACK;
                p += 4;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return FALLBACK; /* a lone low surrogate */
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    uint32_t low;
                    if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || hex4(p + 2, &low))
                        return FALLBACK;
                    if (low < 0xDC00 || low > 0xDFFF) return FALLBACK;
                    p += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                }
                break;
            default: return FALLBACK;
        }
        if (out) bytes += put_utf8(out + bytes, cp);
        else bytes += cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        chars += 1;
    }
    c->p = p;
    if (n_bytes) *n_bytes = bytes;
    if (n_chars) *n_chars = chars;
    return 0;
}

static inline int is_digit(uint8_t ch) { return ch >= '0' && ch <= '9'; }

/* A JSON number; `int_value` gets it when it is an integer of at most 18 digits (else
 * NONE_I64). Numbers a double cannot hold (orjson refuses them) and integers of 19 or more
 * digits (orjson's int or float, by size) fall back. */
static int parse_number(Cur *c, int64_t *int_value) {
    const uint8_t *p = c->p, *end = c->end;
    int neg = 0, digits = 0, is_int = 1;
    int64_t v = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    if (p >= end || !is_digit(*p)) return FALLBACK;
    if (*p == '0') { p++; digits = 1; }
    else
        while (p < end && is_digit(*p)) {
            if (digits < 18) v = v * 10 + (*p - '0');
            digits++;
            p++;
        }
    if (digits > 18) return FALLBACK;
    if (p < end && *p == '.') {
        is_int = 0;
        p++;
        if (p >= end || !is_digit(*p)) return FALLBACK;
        while (p < end && is_digit(*p)) p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        p++;
        int exp_neg = 0, exp = 0;
        if (p < end && (*p == '+' || *p == '-')) { exp_neg = *p == '-'; p++; }
        if (p >= end || !is_digit(*p)) return FALLBACK;
        while (p < end && is_digit(*p)) {
            if (exp < 10000) exp = exp * 10 + (*p - '0');
            p++;
        }
        if (!exp_neg && exp + digits > 300) return FALLBACK;
    }
    c->p = p;
    if (int_value) *int_value = is_int ? (neg ? -v : v) : NONE_I64;
    return 0;
}

static int skip_value(Cur *c);

static int skip_container(Cur *c, uint8_t close, int is_object, int64_t *n_items) {
    int64_t n = 0;
    if (++c->depth > MAX_DEPTH) return FALLBACK;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == close) {
        c->p++;
        c->depth--;
        if (n_items) *n_items = 0;
        return 0;
    }
    for (;;) {
        skip_ws(c);
        if (is_object) {
            if (c->p >= c->end || *c->p != '"' || parse_string(c, NULL, NULL, NULL)) return FALLBACK;
            skip_ws(c);
            if (c->p >= c->end || *c->p != ':') return FALLBACK;
            c->p++;
            skip_ws(c);
        }
        if (skip_value(c)) return FALLBACK;
        n++;
        skip_ws(c);
        if (c->p >= c->end) return FALLBACK;
        if (*c->p == ',') { c->p++; continue; }
        if (*c->p == close) { c->p++; break; }
        return FALLBACK;
    }
    c->depth--;
    if (n_items) *n_items = n;
    return 0;
}

static int literal(Cur *c, const char *word, size_t n) {
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n)) return FALLBACK;
    c->p += n;
    return 0;
}

static int skip_value(Cur *c) {
    if (c->p >= c->end) return FALLBACK;
    switch (*c->p) {
        case '{': return skip_container(c, '}', 1, NULL);
        case '[': return skip_container(c, ']', 0, NULL);
        case '"': return parse_string(c, NULL, NULL, NULL);
        case 't': return literal(c, "true", 4);
        case 'f': return literal(c, "false", 5);
        case 'n': return literal(c, "null", 4);
        default: return parse_number(c, NULL);
    }
}

static inline int is_null(Cur *c) {
    return c->end - c->p >= 4 && !memcmp(c->p, "null", 4);
}

enum {
    KEY_OTHER, KEY_ID, KEY_CHOICES, KEY_USAGE, KEY_ERROR, KEY_TEXT, KEY_DELTA, KEY_CONTENT,
    KEY_FINISH_REASON, KEY_TOKEN_IDS, KEY_COMPLETION_TOKENS, KEY_REASONING, KEY_TOOL_CALLS
};

static int key_code(const uint8_t *k, size_t n) {
#define IS(word) (n == sizeof(word) - 1 && !memcmp(k, word, n))
    switch (n) {
        case 2: return IS("id") ? KEY_ID : KEY_OTHER;
        case 4: return IS("text") ? KEY_TEXT : KEY_OTHER;
        case 5: return IS("usage") ? KEY_USAGE : IS("error") ? KEY_ERROR : IS("delta") ? KEY_DELTA : KEY_OTHER;
        case 7: return IS("choices") ? KEY_CHOICES : IS("content") ? KEY_CONTENT : KEY_OTHER;
        case 9: return IS("token_ids") ? KEY_TOKEN_IDS : IS("reasoning") ? KEY_REASONING : KEY_OTHER;
        case 10: return IS("tool_calls") ? KEY_TOOL_CALLS : KEY_OTHER;
        case 13: return IS("finish_reason") ? KEY_FINISH_REASON : KEY_OTHER;
        case 17:
            return IS("completion_tokens") ? KEY_COMPLETION_TOKENS
                 : IS("reasoning_content") ? KEY_REASONING : KEY_OTHER;
        default: return KEY_OTHER;
    }
#undef IS
}

/* An object key at c->p, as a KEY_ code (escapes decoded first); FALLBACK if invalid. */
static int parse_key(Cur *c) {
    const uint8_t *start = c->p;
    if (c->p >= c->end || *c->p != '"') return FALLBACK;
    const uint8_t *q = plain_run(start + 1, c->end);
    if (q < c->end && *q == '"') { /* a plain key: the common case */
        c->p = q + 1;
        return key_code(start + 1, (size_t)(q - start - 1));
    }
    int64_t n_bytes;
    if (parse_string(c, NULL, &n_bytes, NULL)) return FALLBACK;
    if (n_bytes > 32) return KEY_OTHER;
    uint8_t key[32 * 4];
    Cur again = {start, c->end, 0};
    if (parse_string(&again, key, &n_bytes, NULL)) return FALLBACK;
    return key_code(key, (size_t)n_bytes);
}

/* A text field's value: a string (decoded to `text`) or null; anything else falls back. */
static int text_value(Cur *c, uint8_t *text, Event *e) {
    if (c->p < c->end && *c->p == '"') {
        e->text_at = c->p;
        if (parse_string(c, text, &e->text_bytes, &e->text_chars)) return FALLBACK;
        e->text_end = c->p;
        e->has_text = e->text_bytes > 0;
        return 0;
    }
    if (is_null(c)) {
        c->p += 4;
        forget_text(e);
        return 0;
    }
    return FALLBACK;
}

#define OBJECT_LOOP(c, key, body)                                              \
    do {                                                                       \
        if (++(c)->depth > MAX_DEPTH) return FALLBACK;                         \
        (c)->p++;                                                              \
        skip_ws(c);                                                            \
        if ((c)->p < (c)->end && *(c)->p == '}') { (c)->p++; (c)->depth--; break; } \
        for (;;) {                                                             \
            skip_ws(c);                                                        \
            if ((key = parse_key(c)) < 0) return FALLBACK;                     \
            skip_ws(c);                                                        \
            if ((c)->p >= (c)->end || *(c)->p != ':') return FALLBACK;         \
            (c)->p++;                                                          \
            skip_ws(c);                                                        \
            body                                                               \
            skip_ws(c);                                                        \
            if ((c)->p >= (c)->end) return FALLBACK;                           \
            if (*(c)->p == ',') { (c)->p++; continue; }                        \
            if (*(c)->p == '}') { (c)->p++; break; }                           \
            return FALLBACK;                                                   \
        }                                                                      \
        (c)->depth--;                                                          \
    } while (0)

static int parse_delta(Cur *c, uint8_t *text, Event *e) {
    int key;
    OBJECT_LOOP(c, key, {
        if (key == KEY_CONTENT) {
            if (text_value(c, text, e)) return FALLBACK;
        } else if (key == KEY_REASONING || key == KEY_TOOL_CALLS) {
            /* a reasoning model's thinking, a function call's fragments: Python reads them */
            if (!is_null(c)) return FALLBACK;
            c->p += 4;
        } else if (skip_value(c)) return FALLBACK;
    });
    return 0;
}

static int parse_choice(Cur *c, int chat, uint8_t *text, Event *e) {
    int key;
    OBJECT_LOOP(c, key, {
        if (!chat && key == KEY_TEXT) {
            if (text_value(c, text, e)) return FALLBACK;
        } else if (chat && key == KEY_DELTA) {
            forget_text(e); /* the last delta decides; a delta that is not an object: no text */
            if (c->p < c->end && *c->p == '{') {
                if (parse_delta(c, text, e)) return FALLBACK;
            } else if (skip_value(c)) return FALLBACK;
        } else if (key == KEY_FINISH_REASON) {
            e->finish_start = e->finish_end = NULL;
            if (c->p < c->end && *c->p == '"') {
                const uint8_t *start = c->p;
                int64_t n_bytes;
                if (parse_string(c, NULL, &n_bytes, NULL)) return FALLBACK;
                if (n_bytes) { e->finish_start = start; e->finish_end = c->p; }
            } else if (is_null(c)) c->p += 4;
            else return FALLBACK;
        } else if (key == KEY_TOKEN_IDS) {
            if (c->p < c->end && *c->p == '[') {
                if (skip_container(c, ']', 0, &e->n_ids)) return FALLBACK;
            } else {
                e->n_ids = -1;
                if (skip_value(c)) return FALLBACK;
            }
        } else if (skip_value(c)) return FALLBACK;
    });
    return 0;
}

static int parse_usage(Cur *c, Event *e) {
    int key;
    const uint8_t *start = c->p;
    int n_keys = 0;
    e->usage_completion = NONE_I64;
    OBJECT_LOOP(c, key, {
        n_keys++;
        if (key == KEY_COMPLETION_TOKENS) {
            int64_t value = NONE_I64;
            if (c->p < c->end && (*c->p == '-' || is_digit(*c->p))) {
                if (parse_number(c, &value)) return FALLBACK;
            } else if (skip_value(c)) return FALLBACK;
            e->usage_completion = value;
        } else if (skip_value(c)) return FALLBACK;
    });
    e->usage_start = n_keys ? start : NULL;
    e->usage_end = n_keys ? c->p : NULL;
    return 0;
}

/* `choices`: null, [] or a list whose first item is an object (the one read). */
static int parse_choices(Cur *c, int chat, uint8_t *text, Event *e) {
    /* the last `choices` key decides: forget an earlier one's findings */
    forget_text(e);
    e->n_ids = -1;
    e->finish_start = e->finish_end = NULL;
    if (is_null(c)) { c->p += 4; return 0; }
    if (c->p >= c->end || *c->p != '[') return FALLBACK;
    if (++c->depth > MAX_DEPTH) return FALLBACK;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == ']') { c->p++; c->depth--; return 0; }
    for (int i = 0;; i++) {
        skip_ws(c);
        if (i == 0) {
            if (c->p >= c->end || *c->p != '{') return FALLBACK;
            if (parse_choice(c, chat, text, e)) return FALLBACK;
        } else if (skip_value(c)) return FALLBACK;
        skip_ws(c);
        if (c->p >= c->end) return FALLBACK;
        if (*c->p == ',') { c->p++; continue; }
        if (*c->p == ']') { c->p++; break; }
        return FALLBACK;
    }
    c->depth--;
    return 0;
}

static int parse_event(Cur *c, int chat, uint8_t *text, Event *e) {
    int key;
    memset(e, 0, sizeof *e);
    e->usage_completion = NONE_I64;
    e->n_ids = -1;
    skip_ws(c);
    if (c->p >= c->end || *c->p != '{') return FALLBACK;
    OBJECT_LOOP(c, key, {
        if (key == KEY_ERROR) return FALLBACK; /* the Python parser words the error */
        if (key == KEY_ID) {
            e->id_start = e->id_end = NULL;
            if (c->p < c->end && *c->p == '"') {
                const uint8_t *start = c->p;
                if (parse_string(c, NULL, NULL, NULL)) return FALLBACK;
                e->id_start = start;
                e->id_end = c->p;
            } else if (skip_value(c)) return FALLBACK;
        } else if (key == KEY_CHOICES) {
            if (parse_choices(c, chat, text, e)) return FALLBACK;
        } else if (key == KEY_USAGE) {
            e->usage_start = e->usage_end = NULL;
            e->usage_completion = NONE_I64;
            if (is_null(c)) c->p += 4;
            else if (c->p < c->end && *c->p == '{') {
                if (parse_usage(c, e)) return FALLBACK;
            } else return FALLBACK;
        } else if (skip_value(c)) return FALLBACK;
    });
    skip_ws(c);
    return 0;
}

/* An event read in full whose text came from one string, kept to read the events after it
 * that repeat it byte for byte but for that string: a server's chunks differ in their text
 * only (the id, model, index and nulls repeat), so most events are read with two compares
 * and one string instead of the whole grammar. */
typedef struct {
    const uint8_t *payload; /* NULL: no template yet */
    int64_t head;           /* bytes up to the text string's opening quote, included */
    int64_t tail;           /* bytes after its closing quote, the `\n\n` included */
    Event e;
} Template;

static void keep_template(Template *t, const uint8_t *payload, const uint8_t *event_end,
                          const Event *e) {
    if (!e->text_at) return;
    t->payload = payload;
    t->head = e->text_at - payload + 1;
    t->tail = event_end - e->text_end;
    t->e = *e;
}

/* The event at `payload` read as a repeat of the template: its end (after the `\n\n`), or
 * NULL when it is not one (the full parser reads it then). The bytes before the string being
 * the template's, the parser stands in the same state at the string; the bytes after it
 * being the template's too, it makes the same findings there: the full parse's result. The
 * spans (id, finish reason, usage) stay the template's: no span holds the text string, so
 * each one's bytes are the same in both events. */
static const uint8_t *repeat_event(const Template *t, const uint8_t *payload, const uint8_t *end,
                                   uint8_t *text, Event *e) {
    if (!t->payload || end - payload < t->head + t->tail || memcmp(payload, t->payload, t->head))
        return NULL;
    Cur c = {payload + t->head - 1, end, 0};
    int64_t n_bytes, n_chars;
    if (parse_string(&c, text, &n_bytes, &n_chars)) return NULL;
    if (end - c.p < t->tail || memcmp(c.p, t->e.text_end, (size_t)t->tail)) return NULL;
    *e = t->e;
    e->has_text = n_bytes > 0;
    e->text_bytes = n_bytes;
    e->text_chars = n_chars;
    return c.p + t->tail;
}

/* The caller's buffers, kept from stream to stream: per-event arrays of `cap` entries, the
 * decoded text (room for the stream's bytes), per distinct text its first event, its start in
 * `text` and its slot in `table`, and `info`. `table` (`table_size` slots, a power of two of
 * at least 2 * cap) holds the distinct texts' ids and is all -1 between calls: a call empties
 * the slots it filled, so no call clears the whole table.
 *
 * info: [0] events (not counting [DONE]), [1] 1 if [DONE] ended the stream, [2] text bytes,
 * [3] distinct texts, [4..5] the first string id's span, [6..7] the last non-empty
 * finish_reason's span, [8..9] the last non-empty usage object's span (offsets into the
 * stream; -1: none). */
typedef struct {
    int64_t cap;
    int64_t *ev_t;     /* the time of the read that completed the event */
    int64_t *ev_usage; /* the usage so far it carries; NONE_I64: none */
    int32_t *ev_chars; /* its text's code points (0: no text) */
    int32_t *ev_bytes; /* its text's UTF-8 bytes */
    int32_t *ev_text;  /* its distinct text's id; -1: none */
    int32_t *ev_ids;   /* the length of its token_ids; -1: none */
    uint8_t *text;
    int32_t *first_of_text;
    int32_t *slot_of_text;
    int64_t *text_start;
    int32_t *table;
    int64_t table_size;
    int64_t *info;
} Buffers;

/* The id of the text just decoded at `text + text_pos` (FNV-1a, open addressing, compared
 * byte for byte), a new one if it is the first of its kind. */
static int32_t text_id(Buffers *b, int64_t event, int64_t text_pos, int64_t n_bytes,
                       int64_t *n_distinct) {
    const uint8_t *t = b->text + text_pos;
    uint64_t h = 1469598103934665603ULL;
    for (int64_t k = 0; k < n_bytes; k++) h = (h ^ t[k]) * 1099511628211ULL;
    int64_t mask = b->table_size - 1;
    for (int64_t slot = (int64_t)(h & (uint64_t)mask);; slot = (slot + 1) & mask) {
        int32_t id = b->table[slot];
        if (id < 0) {
            id = (int32_t)(*n_distinct)++;
            b->table[slot] = id;
            b->slot_of_text[id] = (int32_t)slot;
            b->first_of_text[id] = (int32_t)event;
            b->text_start[id] = text_pos;
            return id;
        }
        if (b->ev_bytes[b->first_of_text[id]] == n_bytes &&
            !memcmp(b->text + b->text_start[id], t, (size_t)n_bytes))
            return id;
    }
}

static int64_t scan_events(const uint8_t *s, int64_t n, const int64_t *read_lengths,
                           const int64_t *read_t, int64_t n_reads, int32_t chat, Buffers *b,
                           int64_t *n_distinct) {
    const uint8_t *p = s, *end = s + n;
    int64_t n_events = 0, text_pos = 0, read = 0, read_end = n_reads ? read_lengths[0] : 0;
    int64_t *info = b->info;
    int saw_done = 0;
    Template tpl = {NULL, 0, 0, {0}};
    for (int i = 4; i < 10; i++) info[i] = -1;
    if (n == 0) return FALLBACK;
    while (p < end) {
        if (saw_done) return FALLBACK; /* data after [DONE] */
        if (end - p < 6 || memcmp(p, "data: ", 6)) return FALLBACK;
        const uint8_t *payload = p + 6;
        const uint8_t *next;
        Event e;
        int is_done = end - payload >= 8 && !memcmp(payload, "[DONE]\n\n", 8);
        if (is_done) {
            saw_done = 1;
            next = payload + 8;
        } else if (n_events >= b->cap) {
            return FALLBACK;
        } else if (!(next = repeat_event(&tpl, payload, end, b->text + text_pos, &e))) {
            /* The event is parsed up to the stream's end: neither the grammar (space and tab
             * are its only whitespace here) nor a string (no raw control character) takes a
             * newline or a \r, so a good event stops exactly before its `\n\n`. */
            Cur c = {payload, end, 0};
            if (parse_event(&c, chat, b->text + text_pos, &e)) return FALLBACK;
            if (end - c.p < 2 || c.p[0] != '\n' || c.p[1] != '\n') return FALLBACK;
            next = c.p + 2;
            keep_template(&tpl, payload, next, &e);
        }
        p = next;
        /* the event's time: the read that brought its second newline */
        while (read < n_reads && read_end <= (p - 1) - s)
            if (++read < n_reads) read_end += read_lengths[read];
        if (read >= n_reads) return FALLBACK;
        if (is_done) continue;
        int64_t i = n_events++;
        b->ev_t[i] = read_t[read];
        b->ev_usage[i] = e.usage_completion;
        b->ev_ids[i] = (int32_t)e.n_ids;
        if (e.has_text) {
            if (e.text_chars > INT32_MAX) return FALLBACK;
            b->ev_chars[i] = (int32_t)e.text_chars;
            b->ev_bytes[i] = (int32_t)e.text_bytes;
            b->ev_text[i] = text_id(b, i, text_pos, e.text_bytes, n_distinct);
            text_pos += e.text_bytes;
        } else {
            b->ev_chars[i] = 0;
            b->ev_bytes[i] = 0;
            b->ev_text[i] = -1;
        }
        if (e.id_start && info[4] < 0) { info[4] = e.id_start - s; info[5] = e.id_end - s; }
        if (e.finish_start) { info[6] = e.finish_start - s; info[7] = e.finish_end - s; }
        if (e.usage_start) { info[8] = e.usage_start - s; info[9] = e.usage_end - s; }
    }
    info[0] = n_events;
    info[1] = saw_done;
    info[2] = text_pos;
    info[3] = *n_distinct;
    return 0;
}

/* Scan one whole stream `s` of `n` bytes, read in `n_reads` reads of `read_lengths` bytes at
 * times `read_t`, into `b` (see Buffers). Returns 0, or FALLBACK for anything the Python
 * parser must decide. */
int64_t sse_scan(const uint8_t *s, int64_t n, const int64_t *read_lengths, const int64_t *read_t,
                 int64_t n_reads, int32_t chat, Buffers *b) {
    int64_t n_distinct = 0;
    int64_t status = scan_events(s, n, read_lengths, read_t, n_reads, chat, b, &n_distinct);
    for (int64_t i = 0; i < n_distinct; i++) b->table[b->slot_of_text[i]] = -1;
    return status;
}
