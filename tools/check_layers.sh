#!/bin/sh
# check_layers.sh LAYERS OBJDIR: prove the layering of src/layers.txt from
# the object files. For every vp_/vp__ symbol a file uses (nm: undefined),
# the file defining it must sit in a lower layer, or in the same layer and
# listed before it; a file marked * only its own layer may use; a file
# marked @ is another platform's where its object is missing. Prints each
# edge that breaks the rule and a summary; exits 1 on any.
set -eu
layers=$1
objdir=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# file layer position private, one line per file of the table
sed -e 's/#.*//' "$layers" | awk '
  NF && $1 ~ /^L[0-9]+$/ {
    layer = substr($1, 2)
    for (i = 2; i <= NF; i++) {
      f = $i; private = sub(/\*$/, "", f); platform = sub(/@$/, "", f)
      print f, layer, ++pos, private, platform
    }
  }' >"$tmp/files"

: >"$tmp/defs"
: >"$tmp/uses"
while read -r f layer pos private platform; do
  o="$objdir/$f.o"
  if [ "$platform" = 1 ] && [ ! -f "$o" ]; then continue; fi # another's
  if [ ! -f "$o" ]; then echo "check-layers: $o is missing (run make)"; exit 1; fi
  nm "$o" | awk -v f="$f" '$NF ~ /^vp_/ && $1 != "U" { print $NF, f }' >>"$tmp/defs"
  nm "$o" | awk -v f="$f" '$1 == "U" && $2 ~ /^vp_/ { print f, $2 }' >>"$tmp/uses"
done <"$tmp/files"

# A source file the table does not place is unknown.
src=$(dirname "$layers")
for c in $(find "$src" -name '*.c' | sort); do
  f=${c#"$src"/}; f=${f%.c}
  grep -q "^$f " "$tmp/files" || { echo "unknown file (not in $layers): $f"; echo x >>"$tmp/bad"; }
done

awk -v files="$tmp/files" -v defs="$tmp/defs" '
  BEGIN {
    while ((getline < files) > 0) { L[$1] = $2; P[$1] = $3; priv[$1] = $4 }
    while ((getline < defs) > 0) D[$1] = $2
  }
  {
    user = $1; sym = $2; edges++
    if (!(sym in D)) next   # libc or another library
    def = D[sym]
    if (def == user) next
    ok = L[def] < L[user] || (L[def] == L[user] && P[def] < P[user])
    if (priv[def] && L[def] != L[user]) ok = 0
    if (!ok) {
      printf "upward: %s (L%s) uses %s of %s (L%s)\n", user, L[user], sym, def, L[def]
      bad++
    }
  }
  END {
    printf "check-layers: %d uses of vp_ symbols, %d upward or private\n", edges, bad
    exit bad > 0
  }' "$tmp/uses" || { echo x >>"$tmp/bad"; }
[ ! -s "$tmp/bad" ] 2>/dev/null || exit 1
