/* The strict JSON pull parser of safetensors headers (see json.h). */
#include "json.h"

#include <stdlib.h>
#include <string.h>

void vp__json_init(vp__json_t *j, const char *s, size_t len) {
  *j = (vp__json_t){.s = s, .len = len};
}

static int fail(vp__json_t *j, size_t at, const char *msg) {
  if (!j->err) {
    j->err = msg;
    j->err_pos = at;
  }
  return -1;
}

static void skip_ws(vp__json_t *j) {
  while (j->pos < j->len) {
    char c = j->s[j->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    j->pos++;
  }
}

int vp__json_peek(vp__json_t *j) {
  skip_ws(j);
  return j->pos < j->len ? (unsigned char)j->s[j->pos] : -1;
}

int vp__json_expect(vp__json_t *j, char c, const char *what) {
  if (j->err) return -1;
  if (vp__json_peek(j) != (unsigned char)c)
    return fail(j, j->pos, j->pos < j->len ? what : "unexpected end of JSON");
  j->pos++;
  return 0;
}

int vp__json_member(vp__json_t *j, bool *first, char **key, size_t *klen) {
  *key = NULL;
  if (j->err) return -1;
  int c = vp__json_peek(j);
  if (*first) {
    *first = false;
    if (c == '}') {
      j->pos++;
      return 0;
    }
  } else {
    if (c == '}') {
      j->pos++;
      return 0;
    }
    if (c != ',')
      return fail(j, j->pos, c < 0 ? "unexpected end of JSON"
                                   : "expected ',' or '}' after a member");
    j->pos++;
    c = vp__json_peek(j);
    if (c == '}') return fail(j, j->pos, "trailing comma in an object");
  }
  if (c != '"')
    return fail(j, j->pos, c < 0 ? "unexpected end of JSON"
                                 : "expected a string key");
  if (vp__json_string(j, key, klen)) return -1;
  if (vp__json_expect(j, ':', "expected ':' after a key")) {
    free(*key);
    *key = NULL;
    return -1;
  }
  return 1;
}

int vp__json_element(vp__json_t *j, bool *first) {
  if (j->err) return -1;
  int c = vp__json_peek(j);
  if (c == ']') { /* "[1,]" is caught in the comma branch below */
    *first = false;
    j->pos++;
    return 0;
  }
  if (*first) {
    *first = false;
  } else {
    if (c != ',')
      return fail(j, j->pos, c < 0 ? "unexpected end of JSON"
                                   : "expected ',' or ']' after an element");
    j->pos++;
    c = vp__json_peek(j);
    if (c == ']') return fail(j, j->pos, "trailing comma in an array");
  }
  if (c < 0) return fail(j, j->pos, "unexpected end of JSON");
  return 1;
}

static int hex4(const char *p, uint32_t *out) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    char c = p[i];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
    else return -1;
  }
  *out = v;
  return 0;
}

static size_t put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  o[0] = (char)(0xf0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
  o[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* Length of the well-formed UTF-8 sequence at p (n bytes left), 0 if bad:
 * no overlong forms, no surrogates, nothing past U+10FFFF. */
static size_t utf8_len(const unsigned char *p, size_t n) {
  unsigned char c = p[0];
  size_t len;
  uint32_t cp, min;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) len = 2, cp = c & 0x1f, min = 0x80;
  else if (c >= 0xe0 && c <= 0xef) len = 3, cp = c & 0x0f, min = 0x800;
  else if (c >= 0xf0 && c <= 0xf4) len = 4, cp = c & 0x07, min = 0x10000;
  else return 0;
  if (n < len) return 0;
  for (size_t i = 1; i < len; i++) {
    if ((p[i] & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return len;
}

/* The escape at s[*i] (a backslash): its code point in *cp and *i past it,
 * or an error message with *at where it is. */
static const char *unescape(const vp__json_t *j, size_t end, size_t *i,
                            uint32_t *cp, size_t *at) {
  static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
  const unsigned char *s = (const unsigned char *)j->s;
  const char *e = s[*i + 1] ? strchr(from, s[*i + 1]) : NULL;
  *at = *i;
  if (e) {
    *cp = (unsigned char)to[e - from];
    *i += 2;
    return NULL;
  }
  if (s[*i + 1] != 'u') return "invalid escape in a string";
  if (end - *i < 6 || hex4(j->s + *i + 2, cp))
    return "\\u needs four hex digits";
  *i += 6;
  if (*cp >= 0xdc00 && *cp <= 0xdfff) return "unpaired low surrogate escape";
  if (*cp >= 0xd800 && *cp <= 0xdbff) {
    uint32_t lo;
    if (end - *i < 6 || s[*i] != '\\' || s[*i + 1] != 'u' ||
        hex4(j->s + *i + 2, &lo) || lo < 0xdc00 || lo > 0xdfff)
      return "unpaired high surrogate escape";
    *cp = 0x10000 + ((*cp - 0xd800) << 10) + (lo - 0xdc00);
    *i += 6;
  }
  *at = *i - 6;
  if (*cp == 0) return "\\u0000 (NUL) in a string is not supported";
  return NULL;
}

int vp__json_string(vp__json_t *j, char **out, size_t *len) {
  *out = NULL;
  if (vp__json_expect(j, '"', "expected a string")) return -1;
  /* First pass: find the closing quote, so the output can be sized (a
   * decoded string is never longer than its JSON form). */
  size_t start = j->pos, end = start;
  while (end < j->len && j->s[end] != '"') end += j->s[end] == '\\' ? 2 : 1;
  if (end >= j->len) return fail(j, start - 1, "unterminated string");
  char *o = malloc(end - start + 1);
  if (!o) {
    j->nomem = true;
    return fail(j, start, "out of memory");
  }
  size_t n = 0, i = start;
  const unsigned char *s = (const unsigned char *)j->s;
  while (i < end) {
    unsigned char c = s[i];
    if (c < 0x20) {
      free(o);
      return fail(j, i, "control character in a string (escape it)");
    }
    if (c >= 0x80) {
      size_t l = utf8_len(s + i, end - i);
      if (!l) {
        free(o);
        return fail(j, i, "invalid UTF-8 in a string");
      }
      memcpy(o + n, s + i, l);
      n += l;
      i += l;
      continue;
    }
    if (c != '\\') {
      o[n++] = (char)c;
      i++;
      continue;
    }
    uint32_t cp;
    size_t at;
    const char *bad = unescape(j, end, &i, &cp, &at);
    if (bad) {
      free(o);
      return fail(j, at, bad);
    }
    n += put_utf8(o + n, cp);
  }
  o[n] = '\0';
  j->pos = end + 1;
  *out = o;
  if (len) *len = n;
  return 0;
}

int vp__json_uint(vp__json_t *j, uint64_t *out) {
  if (j->err) return -1;
  int c = vp__json_peek(j);
  size_t at = j->pos;
  if (c == '-') return fail(j, at, "negative number where a non-negative "
                            "integer is required");
  if (c < '0' || c > '9')
    return fail(j, at, c < 0 ? "unexpected end of JSON"
                             : "expected a non-negative integer");
  uint64_t v = 0;
  size_t i = at;
  if (j->s[i] == '0' && i + 1 < j->len && j->s[i + 1] >= '0' &&
      j->s[i + 1] <= '9')
    return fail(j, at, "number with a leading zero");
  for (; i < j->len && j->s[i] >= '0' && j->s[i] <= '9'; i++) {
    uint64_t d = (uint64_t)(j->s[i] - '0');
    if (v > (UINT64_MAX - d) / 10)
      return fail(j, at, "integer does not fit in 64 bits");
    v = v * 10 + d;
  }
  if (i < j->len && (j->s[i] == '.' || j->s[i] == 'e' || j->s[i] == 'E'))
    return fail(j, at, "number with a fraction or exponent where an integer "
                "is required");
  j->pos = i;
  *out = v;
  return 0;
}

int vp__json_end(vp__json_t *j) {
  if (j->err) return -1;
  skip_ws(j);
  if (j->pos != j->len) return fail(j, j->pos, "data after the JSON value");
  return 0;
}
