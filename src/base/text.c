/* text — see text.h. */
#include "base/text.h"

#include <ctype.h>
#include <string.h>

int text_edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 256 || lb > 256) return (int)(la > lb ? la : lb);
    int row[257];
    for (size_t j = 0; j <= lb; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int cost = tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 1]) ? 0 : 1;
            int best = diag + cost;
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

int text_close_name(const char *a, const char *b, int *dist) {
    while (*a == '-')
        a++;
    while (*b == '-')
        b++;
    size_t la = strlen(a), lb = strlen(b), m = la > lb ? la : lb;
    int d = text_edit_distance(a, b);
    *dist = d;
    return m > 0 && (size_t)d * 5 <= m * 2;
}

const char *text_json_kind(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    default:
        return "null";
    }
}
