from typing import Dict, List, Tuple


def merge_intervals(intervals: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Merge overlapping closed intervals and return them sorted by their start.

    >>> merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)])
    [(1, 6), (8, 10), (15, 18)]
    >>> merge_intervals([])
    []
    """
    result: List[Tuple[int, int]] = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(result[-1][1], end))
        else:
            result.append((start, end))
    return result


def count_words(text: str, ignore_case: bool = True) -> Dict[str, int]:
    """Count how often each word occurs in text.

    Words are maximal runs of letters and digits; everything else separates
    them. With ignore_case the keys are lower case.

    >>> count_words("the cat and the hat")
    {'the': 2, 'cat': 1, 'and': 1, 'hat': 1}
    """
