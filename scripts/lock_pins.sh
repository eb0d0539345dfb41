# Sourced by scripts/setup.sh and scripts/test_gpu_set.sh: reading a lock file's pins.

# A lock's pins for Python X.Y: its lines without a marker, and those whose
# `; python_version == "X.Y"` marker names it (locks/gpu.txt has them), without the marker.
lock_pins() {  # lock X.Y
    sed -n -e '/^#/d' -e '/;/!p' -e "s/ *; *python_version == \"$2\"\$//p" "$1"
}

# "name==version" lines with pip's names as the locks': lower case, runs of "-", "_" and "."
# as one "-" (pip freeze writes PyYAML, uv pyyaml); other lines unchanged.
canonical_names() {
    awk -F'==' '/==/ { name = tolower($1); gsub(/[-_.]+/, "-", name); print name "==" $2; next } { print }'
}
