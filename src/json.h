/* A strict, bounded pull parser for the JSON that safetensors headers use:
 * objects, arrays, strings (every escape, \uXXXX with surrogate pairs,
 * UTF-8 checked) and non-negative integers. The caller walks the grammar it
 * expects, so nesting is bounded by that grammar and nothing is built but
 * the strings asked for. RFC 8259 syntax: no trailing commas, no comments,
 * no leading zeros; whitespace is space, tab, CR and LF.
 *
 * Every function returns 0 on success (1 for "a member/element follows" in
 * the iterators) and -1 on the first error, after which j->err holds a
 * static message and j->err_pos the byte offset where it was found;
 * j->nomem is set when the error is a failed allocation. */
#ifndef VPAGER_JSON_H
#define VPAGER_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct vp__json {
  const char *s;
  size_t len, pos;
  const char *err; /* NULL until an error */
  size_t err_pos;
  bool nomem;
} vp__json_t;

void vp__json_init(vp__json_t *j, const char *s, size_t len);
/* The next byte after whitespace (not consumed), or -1 at the end. */
int vp__json_peek(vp__json_t *j);
/* Consume `c` after whitespace; `what` names it in the error. */
int vp__json_expect(vp__json_t *j, char c, const char *what);
/* Members of an object whose '{' was consumed: 1 with *key (malloc'd,
 * NUL-terminated; the caller frees it) when a member follows, its ':'
 * consumed; 0 when the '}' was consumed. *first must be true before the
 * first call. */
int vp__json_member(vp__json_t *j, bool *first, char **key, size_t *klen);
/* Elements of an array whose '[' was consumed: 1 when an element follows
 * (not consumed), 0 when the ']' was consumed. */
int vp__json_element(vp__json_t *j, bool *first);
/* A string value: *out is malloc'd and NUL-terminated; \u0000 is refused
 * (C strings cannot hold it). */
int vp__json_string(vp__json_t *j, char **out, size_t *len);
/* A non-negative integer that fits in 64 bits (no sign, fraction or
 * exponent). */
int vp__json_uint(vp__json_t *j, uint64_t *out);
/* Only whitespace remains. */
int vp__json_end(vp__json_t *j);

#endif /* VPAGER_JSON_H */
